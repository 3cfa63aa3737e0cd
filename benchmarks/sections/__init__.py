"""The benchmark report's sections, one module each (`run(bench)`), that llm-bench (benchmarks/bench.py) runs."""
