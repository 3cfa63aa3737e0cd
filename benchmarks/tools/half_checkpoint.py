"""A Hugging Face checkpoint stored in bf16, served as it is stored: load time, resident memory and decode speed.

For each size (benchmarks/tools/shaped_models.py's Llama-3.2-1B / 3B / Llama-3.1-8B shapes, random weights, the shipped
SmolLM2 tokenizer), a Hugging Face folder in bf16 safetensors (one file per layer, made once into the cache), loaded
in a process of its own by the engine with the served configuration and each `quantization`:

- `half` (what `auto` takes for a 16-bit checkpoint): the checkpoint's own bf16 weights read from its files onto
  our kernel, fp32 arithmetic, no fp32 copy (backend/model/safetensors_weights.py);
- `none`: the same weights loaded in fp32 by transformers and served dense (twice the bytes), where the machine
  has room for it.

Per row: seconds to load, peak resident memory (VmHWM) and resident after loading, the planned weight bytes and
the checkpoint's size on disk, and batch-1 decode tok/s (median step). Writes
benchmarks/results/half_checkpoint/README.md and results.json, with the machine and its CPU flags.

    python -m benchmarks.tools.half_checkpoint [--sizes 1b,3b] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from benchmarks.core import llama_cpp_build
from benchmarks.core.machine import machine_info
from benchmarks.tools import shaped_models
from launcher.paths import MODEL_DIR

OUT = Path(__file__).resolve().parents[1] / "results" / "half_checkpoint"
QUANTIZATIONS = ("half", "none")
DECODE_STEPS = 32
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def _layer_tensors(shape: shaped_models.Shape, i: int) -> list[tuple[str, tuple[int, ...]]]:
    h, q, kv = shape.hidden, shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    p = f"model.layers.{i}"
    return [
        (f"{p}.input_layernorm.weight", (h,)),
        (f"{p}.self_attn.q_proj.weight", (q, h)),
        (f"{p}.self_attn.k_proj.weight", (kv, h)),
        (f"{p}.self_attn.v_proj.weight", (kv, h)),
        (f"{p}.self_attn.o_proj.weight", (h, q)),
        (f"{p}.post_attention_layernorm.weight", (h,)),
        (f"{p}.mlp.gate_proj.weight", (shape.intermediate, h)),
        (f"{p}.mlp.up_proj.weight", (shape.intermediate, h)),
        (f"{p}.mlp.down_proj.weight", (h, shape.intermediate)),
    ]


def write_folder(folder: Path, shape: shaped_models.Shape, tokenizer_dir: Path, seed: int = 0) -> Path:
    """A Llama folder of `shape` with random bf16 weights (norms 1), one safetensors file per layer so that no more
    than a layer is in memory, with `tokenizer_dir`'s tokenizer."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoTokenizer, LlamaConfig

    vocab = len(AutoTokenizer.from_pretrained(tokenizer_dir))
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    groups = [[("model.embed_tokens.weight", (vocab, shape.hidden))]]
    groups += [_layer_tensors(shape, i) for i in range(shape.layers)]
    groups.append(
        [("model.norm.weight", (shape.hidden,))] + ([] if shape.tied else [("lm_head.weight", (vocab, shape.hidden))])
    )
    weight_map, total = {}, 0
    for index, group in enumerate(groups):
        name = f"model-{index + 1:05d}-of-{len(groups):05d}.safetensors"
        tensors = {}
        for tensor, dims in group:
            values = np.ones(dims, np.float32) if len(dims) == 1 else rng.standard_normal(dims, np.float32) * 0.02
            tensors[tensor] = torch.from_numpy(values).to(torch.bfloat16)
            weight_map[tensor] = name
            total += values.size * 2
        save_file(tensors, str(folder / name), metadata={"format": "pt"})
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    LlamaConfig(
        architectures=["LlamaForCausalLM"],
        vocab_size=vocab,
        hidden_size=shape.hidden,
        intermediate_size=shape.intermediate,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        head_dim=shape.head_dim,
        max_position_embeddings=shape.context,
        rope_theta=shape.rope_theta,
        rms_norm_eps=1e-5,
        tie_word_embeddings=shape.tied,
        torch_dtype="bfloat16",
    ).to_json_file(folder / "config.json")
    for file in TOKENIZER_FILES:
        if (tokenizer_dir / file).is_file():
            shutil.copy(tokenizer_dir / file, folder / file)
    return folder


def checkpoint(size: str) -> Path:
    """The `size` bf16 folder, made once into the llama.cpp cache's models folder (where the GGUF shapes are)."""
    folder = llama_cpp_build.cache_dir() / "models" / f"random-{size}-bf16"
    if not (folder / "config.json").is_file():
        partial = folder.with_name(folder.name + ".part")
        shutil.rmtree(partial, ignore_errors=True)
        write_folder(partial, shaped_models.SHAPES[size], MODEL_DIR)
        partial.replace(folder)
    return folder


def _status_kib(key: str) -> int:
    line = next(x for x in Path("/proc/self/status").read_text().splitlines() if x.startswith(key + ":"))
    return int(line.split()[1])


def measure_child(folder: Path, quantization: str) -> dict:
    """In this process: load the engine on `folder` with `quantization`, then decode at batch 1."""
    from backend import EngineConfig, LLMEngine
    from benchmarks.sections.roofline import decode_rate

    started = time.perf_counter()
    engine = LLMEngine(EngineConfig(model=str(folder), quantization=quantization))
    load_s = time.perf_counter() - started
    runner = engine.runner
    row = {
        "quantization": quantization,
        "load_s": round(load_s, 1),
        "peak_mib": _status_kib("VmHWM") // 1024,
        "loaded_mib": _status_kib("VmRSS") // 1024,
        "weights_mib": runner.weight_bytes // 2**20,
        "kv_cache_mib": runner.memory_plan.kv_cache // 2**20,
        "kernel": runner.kernel,
    }
    _, row["batch1_tok_s"] = decode_rate(engine, 1, DECODE_STEPS)
    row["batch1_tok_s"] = round(row["batch1_tok_s"], 2)
    return row


def measure(size: str) -> list[dict]:
    folder = checkpoint(size)
    disk = sum(f.stat().st_size for f in folder.glob("*.safetensors"))
    rows = []
    for quantization in QUANTIZATIONS:
        if quantization == "none" and 2 * disk > _available_bytes() * 0.8:
            rows.append({"size": size, "quantization": quantization, "skipped": "fp32 does not fit this machine"})
            continue
        command = [sys.executable, "-m", "benchmarks.tools.half_checkpoint", "--child", str(folder), quantization]
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"{size} {quantization}: {done.stderr.strip().splitlines()[-1]}")
        row = json.loads(done.stdout.strip().splitlines()[-1])
        rows.append({"size": size, "checkpoint_mib": disk // 2**20, **row})
        print(json.dumps(rows[-1]), flush=True)
    return rows


def _available_bytes() -> int:
    line = next(x for x in Path("/proc/meminfo").read_text().splitlines() if x.startswith("MemAvailable:"))
    return int(line.split()[1]) * 1024


def report(rows: list[dict], machine: dict) -> str:
    lines = [
        "# A bf16 checkpoint served as stored (`python -m benchmarks.tools.half_checkpoint`)",
        "",
        f"Machine: {machine['host_cpu']}, {machine['logical_cpus']} logical CPUs, {machine['memory_gib']} GiB, "
        f"load average at the start {machine['load_average_start']}; CPU flags: {' '.join(machine['cpu_flags'])}; "
        f"our kernel: {machine['kernel_isa']}. Random weights of each shape in bf16 safetensors, the engine in "
        f"process (the served configuration, `quantization` as in the row); batch-1 decode is the median of "
        f"{DECODE_STEPS} steps.",
        "",
        "| size | quantization | checkpoint MiB | weights MiB | peak MiB | after load MiB | load s | batch 1 tok/s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "skipped" in r:
            lines.append(f"| {r['size']} | {r['quantization']} | {r['skipped']} | | | | | |")
            continue
        lines.append(
            f"| {r['size']} | {r['quantization']} | {r['checkpoint_mib']:,} | {r['weights_mib']:,} | "
            f"{r['peak_mib']:,} | {r['loaded_mib']:,} | {r['load_s']} | {r['batch1_tok_s']} |"
        )
    lines += [
        "",
        "Kernels: " + "; ".join(sorted({f"{r['quantization']}: {r['kernel']}" for r in rows if "kernel" in r})),
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="1b,3b")
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("--child", nargs=2, metavar=("FOLDER", "QUANTIZATION"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(measure_child(Path(args.child[0]), args.child[1])))
        return 0
    import torch

    machine = machine_info(torch.get_num_threads())
    rows = [row for size in args.sizes.split(",") for row in measure(size)]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps({"machine": machine, "rows": rows}, indent=2) + "\n")
    text = report(rows, machine)
    (args.out / "README.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
