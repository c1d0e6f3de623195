"""``data.config`` (issue 55): a dataset's subset as ``datasets.load_dataset(id, name, split)``
reads it, TRL's ``dataset_config``; without one, a dataset of several is refused naming
``data.config`` and its subsets (it blamed ``data.split``)."""

from __future__ import annotations

import json

import pytest

from tests.conftest import tiny_run_args
from tether.data.prompts import load_rows
from tether.run.config import load_config

CARD = """---
configs:
- config_name: en
  data_files:
  - split: train
    path: en/train.jsonl
- config_name: fr
  data_files:
  - split: train
    path: fr/train.jsonl
---
"""


@pytest.fixture()
def two_subsets(tmp_path):
    """A dataset folder as a Hub repository lays it out: two subsets declared in its card."""
    folder = tmp_path / "ds"
    for name, word in (("en", "the film"), ("fr", "le film")):
        (folder / name).mkdir(parents=True)
        rows = [{"prompt": f"{word} {i} was", "chosen": " good", "rejected": " bad"} for i in range(40)]
        (folder / name / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (folder / "README.md").write_text(CARD)
    return folder


def test_the_subset_is_the_one_datasets_reads(two_subsets, tmp_path):
    import datasets

    rows, where = load_rows(str(two_subsets), "train", subset="fr")
    fresh = datasets.load_dataset(str(two_subsets), "fr", split="train", cache_dir=str(tmp_path / "cache"))
    assert rows == fresh.to_list()
    assert rows[0]["prompt"] == "le film 0 was" and where[0].endswith("row 1")
    # another folder of the same name and subset, other rows: read as itself (datasets' cache
    # alone would return the first folder's rows)
    other = tmp_path / "elsewhere" / "ds"
    (other / "fr").mkdir(parents=True)
    (other / "fr" / "train.jsonl").write_text('{"prompt": "autre chose"}\n')
    (other / "README.md").write_text(
        CARD.replace("- config_name: en\n  data_files:\n  - split: train\n    path: en/train.jsonl\n", "")
    )
    assert load_rows(str(other), "train", subset="fr")[0] == [{"prompt": "autre chose"}]


def test_several_subsets_and_none_chosen_is_refused_naming_data_config(two_subsets):
    with pytest.raises(ValueError, match=r"data.config: .* has the subsets \['en', 'fr'\]; choose one"):
        load_rows(str(two_subsets), "train")
    with pytest.raises(ValueError, match=r"data.config='de': .* has the subsets \['en', 'fr'\]"):
        load_rows(str(two_subsets), "train", subset="de")


def test_a_subset_of_one_file_is_refused(tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "a b c"}\n')
    with pytest.raises(ValueError, match="is one file, which has no subsets; drop data.config"):
        load_rows(str(f), "train", subset="fr")


def test_a_run_trains_and_holds_out_from_the_subset(tiny_model_dir, two_subsets, tmp_path):
    from tether import train

    args = tiny_run_args(tiny_model_dir, str(two_subsets), tmp_path / "run", {"data.config": "fr"})
    out = train(load_config(None, args))
    prompts = [json.loads(x)["prompt"] for x in (out / "samples.jsonl").read_text().splitlines()]
    assert prompts and all(p.startswith("le film") for p in prompts)


def test_dpo_reads_its_pairs_from_the_subset(tiny_model_dir, two_subsets, tmp_path):
    from tether import train

    overrides = {
        "train.algo": "dpo",
        "dpo.pairs": str(two_subsets),
        "data.prompts": None,
        "data.config": "en",
    }
    out = train(load_config(None, tiny_run_args(tiny_model_dir, None, tmp_path / "dpo", overrides)))
    assert (out / "metrics.jsonl").exists()
    with pytest.raises(ValueError, match="data.config"):
        overrides["data.config"] = None
        train(load_config(None, tiny_run_args(tiny_model_dir, None, tmp_path / "dpo2", overrides)))
