"""The CLI's logging: libraries stay at warnings even when they reset their own level on import."""

from __future__ import annotations

import subprocess
import sys
import textwrap


def test_a_library_that_sets_debug_on_import_stays_quiet() -> None:
    code = textwrap.dedent(
        """
        import logging
        from pipeline.cli.common import setup_logging

        setup_logging("info")
        logging.getLogger("bm25s").setLevel(logging.DEBUG)  # what bm25s does when first imported
        logging.getLogger("bm25s").debug("library debug")
        logging.getLogger("bm25s.tokenization").info("library info")
        logging.getLogger("bm25s").warning("library warning")
        logging.getLogger("causalmem_lab").info("our info")
        """
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "library debug" not in done.stderr and "library info" not in done.stderr
    assert "library warning" in done.stderr and "our info" in done.stderr
