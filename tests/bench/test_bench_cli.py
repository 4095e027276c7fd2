"""``causalmem bench throughput|learning|soak``: subcommands, each with its own flags."""

from __future__ import annotations

import pytest

import pipeline.cli as cli


def parse(line: str) -> object:
    argv = line.split()
    return cli.build_parser(argv).parse_args(argv)


def test_each_bench_takes_its_own_flags() -> None:
    a = parse("bench soak --rate 50 --duration 15 --no-find-max --out x.json")
    assert (a.which, a.rate, a.duration, a.find_max, a.out, a.seed) == ("soak", 50.0, 15.0, False, "x.json", 0)
    assert a.step_seconds is None and a.max_phases is None
    a = parse(
        "bench learning --quick --scenario similarity_good --rows similarity,dynamic --text --seed 1 --out f.json"
    )
    assert (a.which, a.quick, a.scenario, a.rows, a.text, a.seed, a.out) == (
        "learning",
        True,
        "similarity_good",
        "similarity,dynamic",
        True,
        1,
        "f.json",
    )
    a = parse("bench throughput --events 2000")
    assert (a.which, a.events, a.out, a.seed) == ("throughput", 2000, None, 0)
    assert not hasattr(a, "rate") and not hasattr(a, "quick")


@pytest.mark.parametrize(
    "line", ["bench soak --events 5", "bench throughput --quick", "bench learning --rate 3", "bench", "bench nope"]
)
def test_another_bench_flag_or_no_bench_is_rejected(line: str) -> None:
    with pytest.raises(SystemExit):
        parse(line)


def test_common_flags_before_or_after_the_bench_name() -> None:
    after = parse("bench soak --bootstrap 127.0.0.1:1 --partitions 3 --log-level debug")
    before = parse("bench --bootstrap 127.0.0.1:1 --partitions 3 --log-level debug soak")
    for a in (after, before):
        assert (a.bootstrap, a.partitions, a.log_level) == ("127.0.0.1:1", 3, "debug")
    a = parse("bench soak")
    assert (a.bootstrap, a.partitions, a.log_level) == (None, None, "info")


def test_only_the_chosen_bench_is_imported(monkeypatch: pytest.MonkeyPatch) -> None:
    import causalmem_lab.cli.bench as bench

    imported: list[str] = []
    real = bench.importlib.import_module

    def spy(name: str, package: str | None = None) -> object:
        imported.append(name)
        return real(name, package)

    monkeypatch.setattr(bench.importlib, "import_module", spy)
    parse("bench throughput --events 1")
    assert [m for m in imported if m.startswith("causalmem_lab.bench")] == ["causalmem_lab.bench.throughput"]
