"""launcher/model_config.py: engine parameters read from and set in a config.pbtxt, and a repository of variants
written from one model (as the integration tests and the benchmarks write theirs)."""

from pathlib import Path

import pytest

from launcher.model_config import get_parameter, read_parameters, set_parameter, write_model_repository
from launcher.paths import MODEL_DIR
from tests.unit.model_configs import CONFIG


def test_set_parameter_replaces_or_adds():
    text = set_parameter(CONFIG, "dtype", "bfloat16")
    assert get_parameter(text, "dtype") == "bfloat16" and text.count('key: "dtype"') == 1
    text = set_parameter(text, "num_threads", "4")
    assert get_parameter(text, "num_threads") == "4"
    assert get_parameter(text, "model") == "../../models/m"
    assert get_parameter(set_parameter('name: "x"\n', "device", "cuda"), "device") == "cuda"
    with pytest.raises(ValueError):
        set_parameter(CONFIG, "dtype", 'a"b')


def test_read_parameters_makes_the_model_path_absolute(tmp_path):
    (tmp_path / "llm").mkdir()
    (tmp_path / "llm" / "config.pbtxt").write_text(CONFIG)
    params = read_parameters(tmp_path / "llm" / "config.pbtxt")
    assert params == {"model": str(tmp_path.parent.resolve() / "models" / "m"), "dtype": "auto"}


def test_the_shipped_config_names_the_prepared_model():
    params = read_parameters()
    assert Path(params["model"]) == MODEL_DIR


def test_write_model_repository_writes_one_model_per_variant(tmp_path):
    source = tmp_path / "src" / "llm"
    (source / "1").mkdir(parents=True)
    (source / "1" / "model.py").write_text("# model\n")
    (source / "config.pbtxt").write_text(CONFIG)
    forwarding = tmp_path / "src" / "ensemble"
    (forwarding / "1").mkdir(parents=True)
    (forwarding / "1" / "model.py").write_text("# forwarding\n")
    (forwarding / "config.pbtxt").write_text('name: "ensemble"\n')
    tokenizing = tmp_path / "src" / "preprocessing"
    (tokenizing / "1").mkdir(parents=True)
    (tokenizing / "1" / "model.py").write_text("# tokenizer\n")
    (tokenizing / "config.pbtxt").write_text('name: "preprocessing"\n' + set_parameter("", "tokenizer_dir", "../x"))
    root = write_model_repository(
        tmp_path / "repo", {"llm": {}, "llm_fp32": {"dtype": "float32", "max_num_seqs": 4}}, source
    )
    assert sorted(p.name for p in root.iterdir()) == ["ensemble", "llm", "llm_fp32", "preprocessing"]
    # the tokenizer models read the tokenizer of the model `llm` serves
    tokenizer_dir = get_parameter((root / "preprocessing" / "config.pbtxt").read_text(), "tokenizer_dir")
    assert tokenizer_dir == get_parameter((root / "llm" / "config.pbtxt").read_text(), "model")
    assert (root / "ensemble" / "1" / "model.py").read_text() == "# forwarding\n"
    assert (root / "ensemble" / "config.pbtxt").read_text() == 'name: "ensemble"\n'
    model = str((tmp_path / "models" / "m").resolve())
    for name, dtype in (("llm", "auto"), ("llm_fp32", "float32")):
        text = (root / name / "config.pbtxt").read_text()
        assert text.startswith(f'name: "{name}"\n')
        assert get_parameter(text, "dtype") == dtype and get_parameter(text, "model") == model
        assert (root / name / "1" / "model.py").is_symlink()
        assert (root / name / "1" / "model.py").read_text() == "# model\n"
    assert get_parameter((root / "llm_fp32" / "config.pbtxt").read_text(), "max_num_seqs") == "4"
    assert get_parameter((root / "llm" / "config.pbtxt").read_text(), "max_num_seqs") is None
    with pytest.raises(ValueError, match="no top-level name"):
        (source / "config.pbtxt").write_text('backend: "python"\n')
        write_model_repository(tmp_path / "other", {"x": {}}, source)
