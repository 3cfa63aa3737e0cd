"""The harness llm-bench, its sections and the tools share: settings, workloads, server, machine, llama.cpp, report."""
