"""benchmarks/sections/spec_decode.py's table: the end-to-end and the decode-phase ratios against speculation off,
and the prompt's share of the request time, from the summed measurements of each run."""

from benchmarks.sections import spec_decode


def run(wall: float, tokens: int, requests: int, ttft: float, e2e: float, drafted: int = 0, accepted: int = 0):
    sums = dict.fromkeys(spec_decode.SUMS, 0.0)
    sums.update(wall_s=wall, cpu_s=2 * wall, output_tokens=tokens, steps=tokens, requests=requests)
    sums.update(ttft_s=ttft, e2e_s=e2e)
    sums["llm_spec_decode_num_drafts_total"] = 1 if drafted else 0
    sums["llm_spec_decode_num_draft_tokens_total"] = drafted
    sums["llm_spec_decode_num_accepted_tokens_total"] = accepted
    return sums


def test_decode_phase_is_the_time_after_each_first_token():
    # 2 requests, 102 tokens: 100 after the first ones, over 5 s of the 6 s of request time
    assert spec_decode.decode_tokens_per_s(run(6.0, 102, 2, 1.0, 6.0)) == 20.0


def test_table_gives_end_to_end_and_decode_ratios_and_the_prompt_share():
    # the prompt's pass (1 s) is the same with and without speculation; decoding is twice as fast with it
    off = run(6.0, 102, 2, 1.0, 6.0)
    suffix = run(3.5, 102, 2, 1.0, 3.5, drafted=80, accepted=60)
    lines = spec_decode.table({"agentic": {"off": [off], "suffix": [suffix]}}, 1)
    header = next(line for line in lines if line.startswith("| workload"))
    rows = {line.split(" | ")[1]: line.strip("| ").split(" | ") for line in lines if line.startswith("| agentic")}
    cells = dict(zip(header.strip("| ").split(" | "), rows["suffix"]))
    assert cells["output tok/s"] == "29.1" and cells["decode tok/s"] == "40.0"
    vs_off = [c for h, c in zip(header.strip("| ").split(" | "), rows["suffix"]) if h == "vs off"]
    assert vs_off == ["1.71x", "1.71x", "2.00x"]  # wall, CPU, decode phase
    assert cells["prompt share"] == "29%"
    assert cells["acceptance rate"] == "0.750"
    assert dict(zip(header.strip("| ").split(" | "), rows["off"]))["prompt share"] == "17%"
