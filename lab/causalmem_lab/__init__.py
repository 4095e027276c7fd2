"""The lab: simulator, text bank, scenario runs, the in-process loop, the demo and the benchmarks."""
