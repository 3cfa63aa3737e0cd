"""Test support shared by the unit and integration tests, the benchmarks and the load tests.

Light to import: no module here imports torch or transformers at import time (each imports them inside the
function that needs them), and nothing here imports from tests/.

    testkit.prompts       the mixed prompt set (MIXED_CASES) and the texts it is built from
    testkit.hf_reference  the one Hugging Face greedy reference (`transformers` `generate`), with its cache
    testkit.fidelity      comparing greedy completions: the near-tie rule, first_mismatch
    testkit.prometheus    the one Prometheus text-format parser, and scrape(url)
    testkit.stats         the one percentile definition
    testkit.concurrency   run_concurrently, raise_first_error
    testkit.server_variants  the integration repository's model variants (VARIANTS, FRONTEND_MODELS)
"""
