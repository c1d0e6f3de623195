"""``tether push RUN ORG/NAME``: a run's saved policy, with its model card, to the Hugging Face Hub.

One commit through ``huggingface_hub``: every file of ``<run>/policy`` (the weights or the LoRA
adapter, the tokenizer, ``value_head.safetensors`` where PPO trained one, the plots) and its
``README.md`` with the loading example naming the repository. Nothing is read from the run
folder but files to upload (no code runs from it), and a run folder holding a symbolic link is
refused (its target's bytes would be uploaded). The repository is created private unless
``private=False`` (``--public``).
"""

from __future__ import annotations

import os
from pathlib import Path

from tether.run.folder import check_no_links

OFFLINE_VALUES = ("1", "ON", "YES", "TRUE")
"""Values of ``HF_HUB_OFFLINE`` that mean offline, as ``huggingface_hub`` reads them."""


def offline() -> bool:
    """Whether ``HF_HUB_OFFLINE`` says the Hub may not be reached."""
    return os.environ.get("HF_HUB_OFFLINE", "").strip().upper() in OFFLINE_VALUES


def push(run_dir: str | Path, repo_id: str, *, private: bool = True, token: str | None = None) -> str:
    """Upload ``run_dir/policy`` to the model repository ``repo_id`` (created if missing, private
    unless ``private=False``; an existing repository keeps its visibility); returns the commit's URL.

    Raises:
        FileNotFoundError: no saved policy in the run folder (``train.save_model=false``, or a run
            that has not ended).
        tether.run.files.RunFolderError: the run folder holds a symbolic link (nothing is read).
        ValueError: ``repo_id`` is not ``ORG/NAME``.
        RuntimeError: ``HF_HUB_OFFLINE`` is set, or the Hub refused or could not be reached (the
            cause named; nothing in the run folder changes).
    """
    from huggingface_hub import CommitOperationAdd, HfApi
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    check_no_links(Path(run_dir), "tether push")
    folder = Path(run_dir) / "policy"
    if not (folder.is_dir() and any(folder.iterdir())):
        raise FileNotFoundError(
            f"tether push: {folder} holds no saved policy (a run with train.save_model=true writes it "
            "when it ends)"
        )
    try:
        validate_repo_id(repo_id)
        if repo_id.count("/") != 1:
            raise HFValidationError("needs exactly one /")
    except HFValidationError as e:
        raise ValueError(f"tether push: repository {repo_id!r} is not ORG/NAME ({e})") from None
    if offline():
        raise RuntimeError(
            f"tether push: HF_HUB_OFFLINE={os.environ['HF_HUB_OFFLINE']} is set, and uploading to the Hub "
            "needs the network; unset it (or HF_HUB_OFFLINE=0) and log in (hf auth login or HF_TOKEN)"
        )
    adapter = folder / "adapter_config.json"
    if adapter.exists():
        import json

        base = json.loads(adapter.read_text()).get("base_model_name_or_path", "")
        if base and (Path(base).expanduser().is_absolute() or base.startswith((".", "~"))):
            raise ValueError(
                f"tether push: {adapter} names its base model by a local path ({base}), so the adapter "
                "would load on no other machine; train from a Hub id (model.name=ORG/NAME), or push the "
                "base model too and set base_model_name_or_path to its id"
            )
    operations = []
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        rel = path.relative_to(folder).as_posix()
        if rel == "README.md":  # the card's loading example names the repository
            text = path.read_text(encoding="utf-8").replace("PATH/TO/policy", repo_id)
            operations.append(CommitOperationAdd(path_in_repo=rel, path_or_fileobj=text.encode()))
        else:
            operations.append(CommitOperationAdd(path_in_repo=rel, path_or_fileobj=str(path)))
    api = HfApi(token=token)
    try:
        api.create_repo(repo_id, private=private, exist_ok=True, repo_type="model")
        info = api.create_commit(
            repo_id,
            operations=operations,
            commit_message=f"tether: the policy of {Path(run_dir).resolve().name}",
            repo_type="model",
        )
    except Exception as e:  # the Hub's HTTP errors, a refused token, no network: named, not a traceback
        raise RuntimeError(
            f"tether push: uploading {folder} to {repo_id} failed ({type(e).__name__}: {e})"
        ) from e
    return str(getattr(info, "commit_url", info))
