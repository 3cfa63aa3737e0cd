"""benchmarks/tools/half_checkpoint.py on its tiny shape: the bf16 folder it writes is a 16-bit checkpoint the engine
serves from its files, and a measured row reaches the report."""

from backend.model import model_source
from benchmarks.tools import half_checkpoint, shaped_models
from tests.unit.conftest import SMOL_DIR


def test_a_tiny_bf16_folder_is_served_from_its_files_and_reported(tmp_path, tiny_model_factory):
    tiny_model_factory("llama")  # skips without the tokenizer
    folder = half_checkpoint.write_folder(tmp_path / "tiny-bf16", shaped_models.SHAPES["tiny"], SMOL_DIR)
    assert model_source.stored_in_16_bits(folder)
    assert len(list(folder.glob("*.safetensors"))) == shaped_models.SHAPES["tiny"].layers + 2
    row = half_checkpoint.measure_child(folder, "half")
    assert "low-bit kernel" in row["kernel"] and row["batch1_tok_s"] > 0
    assert row["peak_mib"] >= row["loaded_mib"] > 0
    row = {"size": "tiny", "checkpoint_mib": 1, **row}
    machine = {"host_cpu": "cpu", "logical_cpus": 2, "memory_gib": 1, "load_average_start": [0], "cpu_flags": ["avx2"]}
    text = half_checkpoint.report([row], {**machine, "kernel_isa": "avx2"})
    assert "| tiny | half | 1 |" in text and "avx2" in text
