"""A saved policy travels (issue 33): its model card, `tether push`, and a LoRA adapter that names
its Hub base by id so that it loads after the cache moved."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys

import pytest

from tests.conftest import REPO, SHA, hub_cache, metric_rows, offline_cli, tiny_run_args
from tether.cli import main


@pytest.fixture(scope="module")
def saved_run(tiny_model_dir, tmp_path_factory):
    """A tiny PPO run with a final evaluation and a saved policy (shared by the tests below)."""
    tmp = tmp_path_factory.mktemp("saved")
    prompts = tmp / "prompts.txt"
    prompts.write_text("\n".join(f"the movie number {i} was" for i in range(40)) + "\n")
    out = tmp / "run"
    overrides = {"train.steps": 2, "eval.n_prompts": 4, "train.save_model": "true"}
    assert main(tiny_run_args(tiny_model_dir, prompts, out, overrides, command=True)) == 0
    return out


def _digest(folder):
    return {
        p.relative_to(folder).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def test_the_saved_policy_has_a_model_card(saved_run):
    from huggingface_hub import ModelCard

    card_path = saved_run / "policy" / "README.md"
    card = ModelCard.load(card_path)
    assert set(card.data.tags) >= {"tether", "rlhf", "ppo", "kl-regularized"}
    assert card.data.library_name == "transformers"
    text = card_path.read_text()
    ev = json.loads((saved_run / "eval.json").read_text())
    # the held-out gain with its SE, as eval.json holds it; the leash and its placement
    assert f"{ev['gain']:+.3f} ± {ev['gain_se_paired']:.3f}" in text
    assert "KL placement | in the reward (shaping, per token); per-token estimator k1" in text
    assert "`kl.controller=budget`, budget 2.5 nats per sequence" in text
    betas = [r["objective/kl_coef"] for r in metric_rows(saved_run)]
    assert f"beta's path | {betas[0]:.4g} at step 0" in text and "# run: PPO on a KL leash" in text
    assert "fluency NLL" in text and "distinct-2" in text
    assert "AutoModelForCausalLM.from_pretrained" in text
    for plot in ("training.png", "score_vs_kl.png"):  # the card shows them: they travel with it
        assert (saved_run / "policy" / plot).exists() and f"({plot})" in text
    # PPO trains a value head: it is saved, and the card says what it is
    assert (saved_run / "policy" / "value_head.safetensors").exists() and "value_head.safetensors" in text
    import transformers

    assert "## Framework versions" in text and f"- transformers: {transformers.__version__}" in text
    print("\n" + text)


def test_a_grpo_policy_has_no_value_head_and_the_card_names_hub_datasets(
    tiny_model_dir, prompt_file, tmp_path
):
    """GRPO never trains the value head: it is not saved (so not pushed); the card's metadata
    names the Hub datasets a run read, not a local file."""
    from huggingface_hub import ModelCard

    from tether.run.card import hub_datasets, model_card_text
    from tether.run.config import Config

    out = tmp_path / "grpo"
    overrides = {"train.algo": "grpo", "train.steps": 1, "train.save_model": "true"}
    assert main(tiny_run_args(tiny_model_dir, prompt_file, out, overrides, command=True)) == 0
    assert not (out / "policy" / "value_head.safetensors").exists()
    assert "value_head" not in (out / "policy" / "README.md").read_text()
    config = Config().to_dict()
    config["data"]["prompts"], config["data"]["eval_prompts"] = "trl-lib/tldr", str(prompt_file)
    config["model"]["name"] = "Qwen/Qwen3-0.6B"  # a Hub base (the embedded default is a GGUF: none)
    assert hub_datasets(config) == ["trl-lib/tldr"]
    text = model_card_text(config=config, history=[], evaluation=None, adapter=False, versions={"torch": "2"})
    card = ModelCard(text)
    assert card.data.datasets == ["trl-lib/tldr"] and card.data.base_model == "Qwen/Qwen3-0.6B"
    assert "- torch: 2" in text


def test_push_offline_names_hf_hub_offline_and_changes_nothing(saved_run, monkeypatch, capsys):
    before = _digest(saved_run)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert main(["push", str(saved_run), "my-org/my-policy"]) == 1
    err = capsys.readouterr().err
    assert "HF_HUB_OFFLINE=1 is set" in err and "unset it" in err
    print(err)
    assert _digest(saved_run) == before


def test_push_refuses_a_bad_repository_and_a_run_without_a_policy(saved_run, tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    assert main(["push", str(saved_run), "no-slash"]) == 1
    assert "is not ORG/NAME" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert main(["push", str(tmp_path / "empty"), "my-org/my-policy"]) == 1
    assert "holds no saved policy" in capsys.readouterr().err


def test_push_uploads_every_file_in_one_commit_with_the_card_naming_the_repo(saved_run, monkeypatch):
    from huggingface_hub import HfApi

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    calls = {}
    monkeypatch.setattr(
        HfApi, "create_repo", lambda self, repo_id, **kw: calls.setdefault("repo", (repo_id, kw))
    )

    def create_commit(self, repo_id, operations, **kw):
        calls["ops"] = operations
        return type("Info", (), {"commit_url": f"https://huggingface.co/{repo_id}/commit/abc"})()

    monkeypatch.setattr(HfApi, "create_commit", create_commit)
    assert main(["push", str(saved_run), "my-org/my-policy", "--private"]) == 0
    assert calls["repo"] == ("my-org/my-policy", {"private": True, "exist_ok": True, "repo_type": "model"})
    names = {op.path_in_repo for op in calls["ops"]}
    assert names == set(_digest(saved_run / "policy"))
    card = next(op for op in calls["ops"] if op.path_in_repo == "README.md")
    text = (
        card.path_or_fileobj.read().decode()
        if hasattr(card.path_or_fileobj, "read")
        else card.path_or_fileobj.decode()
    )
    assert 'from_pretrained("my-org/my-policy")' in text and "PATH/TO/policy" not in text


def test_a_lora_adapter_names_its_hub_base_and_loads_after_the_cache_moved(
    tiny_model_dir, prompt_file, tmp_path
):
    pytest.importorskip("peft")
    home = tmp_path / "hf"
    hub_cache(home, "tiny-org/tiny-llama", tiny_model_dir)
    out = tmp_path / "run"
    args = tiny_run_args(
        None, prompt_file, out, {"model.lora_r": 4, "train.save_model": "true"}, command=True
    )
    p = offline_cli(home, *args, "model.name=tiny-org/tiny-llama")
    assert p.returncode == 0, p.stderr[-3000:]
    adapter = json.loads((out / "policy" / "adapter_config.json").read_text())
    assert adapter["base_model_name_or_path"] == "tiny-org/tiny-llama" and adapter["revision"] == SHA
    assert "library_name: peft" in (out / "policy" / "README.md").read_text()
    moved = tmp_path / "elsewhere" / "hf"
    shutil.move(str(home), str(moved))  # the cache moved: no path in the adapter may point into it
    load = (
        "import sys, torch; from peft import AutoPeftModelForCausalLM; "
        "m = AutoPeftModelForCausalLM.from_pretrained(sys.argv[1]); "
        "print(sum(p.numel() for n, p in m.named_parameters() if 'lora_' in n))"
    )
    env = dict(os.environ, HF_HOME=str(moved), HF_HUB_OFFLINE="1", PYTHONPATH=str(REPO))
    env.pop("HF_HUB_CACHE", None)
    r = subprocess.run(
        [sys.executable, "-c", load, str(out / "policy")],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert int(r.stdout.split()[-1]) > 0  # the adapter's LoRA weights are on the base loaded by id


def test_push_refuses_an_adapter_whose_base_is_a_local_path(saved_run, tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    run = tmp_path / "lora-run"
    shutil.copytree(saved_run / "policy", run / "policy")
    (run / "policy" / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": "/data/base"}))
    assert main(["push", str(run), "my-org/my-adapter"]) == 1
    err = capsys.readouterr().err
    assert "names its base model by a local path (/data/base)" in err and "model.name=ORG/NAME" in err


def _mock_hub(monkeypatch) -> dict:
    """HfApi's create_repo and create_commit, recording their calls (nothing reaches the network)."""
    from huggingface_hub import HfApi

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    calls = {}
    monkeypatch.setattr(HfApi, "create_repo", lambda self, repo_id, **kw: calls.setdefault("repo", kw))

    def create_commit(self, repo_id, operations, **kw):
        calls["ops"] = operations
        return type("Info", (), {"commit_url": f"https://huggingface.co/{repo_id}/commit/abc"})()

    monkeypatch.setattr(HfApi, "create_commit", create_commit)
    return calls


def test_push_creates_a_private_repository_unless_told(saved_run, monkeypatch, capsys):
    """Issue 50, item 4: a repository was created public unless --private was given."""
    calls = _mock_hub(monkeypatch)
    assert main(["push", str(saved_run), "my-org/my-policy"]) == 0
    assert calls.pop("repo")["private"] is True
    assert "(private if created now; an existing repository keeps its visibility)" in capsys.readouterr().out
    assert main(["push", str(saved_run), "my-org/my-policy", "--public"]) == 0
    assert calls.pop("repo")["private"] is False


def test_push_refuses_a_link_in_the_policy_folder(saved_run, tmp_path, monkeypatch, capsys):
    """Issue 50, item 4: a symbolic link in policy/ uploaded the bytes of the file it points to,
    outside the run. The run folder is refused, naming the link; nothing is uploaded."""
    calls = _mock_hub(monkeypatch)
    run = tmp_path / "run"
    shutil.copytree(saved_run / "policy", run / "policy")
    (tmp_path / "secret.txt").write_text("SECRET")
    (run / "policy" / "notes.txt").symlink_to(tmp_path / "secret.txt")
    assert main(["push", str(run), "my-org/my-policy"]) == 1
    err = capsys.readouterr().err
    assert f"policy/notes.txt -> {tmp_path / 'secret.txt'} (outside the run)" in err, err
    assert calls == {}


def test_the_card_escapes_the_users_text(tmp_path):
    """Issue 50, item 8: a run name with markup went raw into the card's title (and a path with a
    ``|`` or a backtick broke its table). Each renders as written, adding no HTML, link or cell."""
    markdown_it = pytest.importorskip("markdown_it")
    from huggingface_hub import ModelCard

    from tether.run.card import model_card_text
    from tether.run.config import Config

    config = Config().to_dict()
    name = "<img src=x onerror=alert(1)> [click](javascript:alert(1)) *big* #"
    config["data"]["prompts"] = "my|file`s.txt"
    config["model"]["name"] = "org/model\nlicense: mit"  # a YAML key smuggled into the header
    text = model_card_text(config=config, history=[], evaluation=None, adapter=False, name=name)
    page = markdown_it.MarkdownIt("commonmark").enable("table").render(text.split("\n---\n", 1)[1])
    title = page.split("<h1>")[1].split("</h1>")[0]
    print(title)
    assert title == (
        "&lt;img src=x onerror=alert(1)&gt; [click](javascript:alert(1)) *big* #: PPO on a KL leash"
    )
    assert page.count("<img") == 2 and "<a " not in page and "<em>" not in page  # the two plots alone
    data_row = next(row for row in page.split("<tr>") if "<td>data</td>" in row)
    assert data_row.count("<td>") == 2 and "<code>my|file`s.txt</code>" in data_row
    (tmp_path / "README.md").write_text(text)
    card = ModelCard.load(tmp_path / "README.md")
    assert card.data.license is None and "license" not in card.data.to_dict()


def test_train_hub_model_id_pushes_the_policy_when_the_run_ends(
    tiny_model_dir, prompt_file, tmp_path, monkeypatch, capsys
):
    """TRL's push_to_hub + hub_model_id: the saved policy and its card, one commit when the run
    ends; offline, refused before anything is written; an upload that fails leaves the run whole
    and says how to retry."""
    from huggingface_hub import HfApi

    calls = {}
    monkeypatch.setattr(
        HfApi, "create_repo", lambda self, repo_id, **kw: calls.setdefault("repo", (repo_id, kw))
    )

    def create_commit(self, repo_id, operations, **kw):
        calls["files"] = sorted(op.path_in_repo for op in operations)
        return type("Info", (), {"commit_url": f"https://huggingface.co/{repo_id}/commit/abc"})()

    monkeypatch.setattr(HfApi, "create_commit", create_commit)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    out = tmp_path / "run"
    hub = {"train.steps": 1, "train.save_model": "true", "train.hub_model_id": "my-org/my-policy"}
    assert main(tiny_run_args(tiny_model_dir, prompt_file, out, hub, command=True)) == 0
    assert calls["repo"] == ("my-org/my-policy", {"private": True, "exist_ok": True, "repo_type": "model"})
    assert calls["files"] == sorted(
        p.relative_to(out / "policy").as_posix() for p in (out / "policy").rglob("*") if p.is_file()
    )
    assert "pushed the policy to my-org/my-policy" in capsys.readouterr().out
    # offline: said before the run starts, nothing written
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert main(tiny_run_args(tiny_model_dir, prompt_file, tmp_path / "off", hub, command=True)) == 2
    assert "HF_HUB_OFFLINE is set" in capsys.readouterr().err and not (tmp_path / "off").exists()
    # an upload that fails: the run is complete, the policy saved, the retry named
    monkeypatch.delenv("HF_HUB_OFFLINE")

    def refused(self, repo_id, operations, **kw):
        raise OSError("401 unauthorized")

    monkeypatch.setattr(HfApi, "create_commit", refused)
    assert main(tiny_run_args(tiny_model_dir, prompt_file, tmp_path / "fail", hub, command=True)) == 1
    err = capsys.readouterr().err
    assert "401 unauthorized" in err and f"tether push {tmp_path / 'fail'} my-org/my-policy" in err
    assert (tmp_path / "fail" / "metrics.jsonl").exists() and (
        tmp_path / "fail" / "policy" / "README.md"
    ).exists()
    with pytest.raises(Exception, match="set train.save_model=true"):
        from tether.run.config import load_config

        load_config(None, ["train.hub_model_id=a/b", "train.save_model=false"])
