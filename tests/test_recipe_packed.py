"""The packed-documents recipe runs offline on the bundled data and saves a loadable model."""

import importlib.util
import math
from pathlib import Path

from transformers import AutoModelForCausalLM

RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "packed_documents.py"


def test_packed_documents_recipe(tmp_path):
    spec = importlib.util.spec_from_file_location("packed_documents", RECIPE)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    out = tmp_path / "out"
    result = mod.main(
        [
            "--max-steps",
            "3",
            "--docs-per-row",
            "4",
            "--max-doc-tokens",
            "64",
            "--output-dir",
            str(out),
        ]
    )
    assert result["documents"] > 100  # the bundled corpus has hundreds of paragraph blocks
    assert all(math.isfinite(h["loss"]) for h in result["logs"])
    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.config.model_type == "llama"
