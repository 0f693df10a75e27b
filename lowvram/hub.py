"""The one network read of planning: a model's config.json from the Hugging Face Hub.

``lowvram plan --model org/name`` for a model that is neither in the catalog nor in the hub cache
downloads that file only (``hf_hub_download(repo_id, "config.json")``: a few KB, no weights) into
the hub cache, where ``lowvram.plan.model.models`` finds it from then on (offline too). Kept out of
``plan/``, which stays pure: the CLI calls this before it plans. huggingface_hub reads HF_TOKEN
(gated and private repos) and HF_HUB_CACHE / HF_HOME itself; HF_HUB_OFFLINE is checked here first
so that an offline machine gets one clear error instead of a connection attempt.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from lowvram.errors import LowvramError, ModelError

# A name that may be a hub id (train/ reads anything else as a local path): "org/name", or a bare
# name (old canonical models and datasets, e.g. "gpt2", "squad").
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")
# A hub repo id: "org/name" (huggingface_hub validate_repo_id: letters, digits, - _ . ; no "--"
# or ".." and no leading/trailing - or .).
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]{0,95}/[A-Za-z0-9][\w.-]{0,95}$")
_TRUE = {"1", "true", "yes", "on"}


def looks_like_hub_id(ref: str) -> bool:
    """True for "org/name" that is no local path (a folder or file of that name wins)."""
    ref = ref.strip()
    return bool(_REPO_ID.match(ref)) and ".." not in ref and "--" not in ref and not Path(ref).exists()


def hub_offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in _TRUE


_REACHABLE: dict[str, bool] = {}  # one network check per process


def hub_reachable(timeout_s: float = 3.0) -> bool:
    """The hub (HF_ENDPOINT, else huggingface.co) answers a TCP connection within ``timeout_s``:
    checked once per process, so a machine with no network is told so in seconds instead of after
    huggingface_hub's retries (about 80 s of back-off, a dozen log lines)."""
    import socket
    from urllib.parse import urlparse

    url = urlparse(os.environ.get("HF_ENDPOINT") or "https://huggingface.co")
    key = f"{url.hostname}:{url.port or 443}"
    if key not in _REACHABLE:
        try:
            socket.create_connection((url.hostname, url.port or 443), timeout=timeout_s).close()
            _REACHABLE[key] = True
        except OSError:
            _REACHABLE[key] = False
    return _REACHABLE[key]


def hub_model_cached(repo_id: str) -> bool:
    """The hub cache holds the model's config and weights (a single file or the index of shards)."""
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        return False
    found = [try_to_load_from_cache(repo_id, f) for f in ("config.json", "model.safetensors",
                                                          "model.safetensors.index.json", "pytorch_model.bin")]
    return isinstance(found[0], str) and any(isinstance(f, str) for f in found[1:])


def download_problem(repo_id: str) -> str | None:
    """Why a hub model that is not in the cache cannot be downloaded now (offline, no network),
    or None (it is cached, or the hub answers)."""
    if hub_model_cached(repo_id):
        return None
    from lowvram.plan.model.catalog import catalog_hub_id

    if "/" not in repo_id and (hub := catalog_hub_id(repo_id)):  # a catalog short name: plans, never loads
        return (f"model {repo_id} is a name of lowvram's catalog, which plans but does not load: set "
                f"model.name_or_path to its hub id {hub} or to a local folder")
    if hub_offline():
        return (f"model {repo_id} is not in the hub cache and HF_HUB_OFFLINE is set (download it first: "
                f"`hf download {repo_id}`, or set model.name_or_path to a local folder)")
    if not hub_reachable():
        host = os.environ.get("HF_ENDPOINT") or "huggingface.co"
        return (f"no network: {host} cannot be reached, and model {repo_id} is not in the hub cache "
                f"(download it on a machine with network: `hf download {repo_id}`, then copy the "
                "folder and set model.name_or_path to it)")
    return None


def ensure_config(model_ref: str, download=None) -> Path | None:
    """For a hub id that neither the catalog nor the hub cache knows, fetch its config.json (the
    path); None when nothing needed fetching (catalog name, local path, cached hub id)."""
    from lowvram.plan.model.catalog import hub_cache_config, is_catalog_name

    ref = model_ref.strip()
    if not looks_like_hub_id(ref) or is_catalog_name(ref) or hub_cache_config(ref) is not None:
        return None
    return fetch_config(ref, download)


def fetch_config(repo_id: str, download=None) -> Path:
    """Download ``repo_id``'s config.json into the hub cache and return its path.

    ``download`` defaults to ``huggingface_hub.hf_hub_download`` (tests pass a stand-in)."""
    if hub_offline():
        raise ModelError(
            f"'{repo_id}' is not in the catalog and its config.json is not in the hub cache "
            "(HF_HUB_OFFLINE is set, so it was not downloaded)",
            "unset HF_HUB_OFFLINE to fetch that one file (a few KB), or pass a local folder with "
            "config.json; catalog models: `lowvram plan --list-models`")
    if download is None:
        if not hub_reachable():
            raise ModelError(f"no network: the Hugging Face Hub cannot be reached to fetch the config.json of "
                             f"'{repo_id}'",
                             "connect to the network, or pass a local folder with config.json (or "
                             "set HF_HUB_OFFLINE=1 to use the hub cache only)")
        from huggingface_hub import hf_hub_download as download
    try:
        return Path(download(repo_id=repo_id, filename="config.json"))
    except Exception as err:  # noqa: BLE001 - every failure becomes one error + hint below
        raise _hub_error(repo_id, err) from None


def _hub_error(repo_id: str, err: Exception) -> LowvramError:
    """huggingface_hub's exceptions as one message and one hint (names checked by class name, so
    a stand-in downloader in tests can raise the same kinds)."""
    kinds = {cls.__name__ for cls in type(err).__mro__}
    if "GatedRepoError" in kinds:
        return ModelError(f"'{repo_id}' is a gated model: its config.json needs an accepted "
                          "license and a token",
                          f"accept the terms on https://huggingface.co/{repo_id}, then set HF_TOKEN "
                          "(or run `hf auth login`)")
    if "RepositoryNotFoundError" in kinds:
        return ModelError(f"no model '{repo_id}' on the Hugging Face Hub (or it is private)",
                          "check the spelling (org/name), set HF_TOKEN for a private repo, or "
                          "see `lowvram plan --list-models`")
    if "RemoteEntryNotFoundError" in kinds:
        return ModelError(f"'{repo_id}' has no config.json on the hub (a GGUF-only or non-"
                          "transformers repo?)",
                          "download the model and pass its folder (config.json or a .gguf file)")
    if "HFValidationError" in kinds:
        return ModelError(f"'{repo_id}' is not a valid hub repo id", "use the form org/name")
    return ModelError(f"could not fetch the config.json of '{repo_id}' from the Hugging Face Hub: "
                      f"{str(err).splitlines()[0] if str(err) else type(err).__name__}",
                      "check the network (or set HF_HUB_OFFLINE=1 and pass a local folder with "
                      "config.json)")


__all__ = ["download_problem", "ensure_config", "fetch_config", "hub_offline", "hub_reachable", "looks_like_hub_id"]
