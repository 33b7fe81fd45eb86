"""Model dirs and the Hugging Face Hub: a folder or a repo id resolved to a model dir, pull, push.

Hub calls go to `HF_ENDPOINT` (read at call time) with the token from the `token`
argument, `HF_TOKEN` or the cached login (`hf auth login`); the token is only ever sent in
request headers. With `HF_HUB_OFFLINE=1` repo ids are served from the local cache.
Problems a user can fix surface as a one-line `HubError` (a `vit_hub.errors.UserError`).

Edited cards are kept. Every card vit_hub writes is sealed with a checksum (see
`vit_hub.hub.card`). On push:
  - README.md on the Hub missing, or still sealed (nobody edited it) -> replaced by ours;
  - README.md on the Hub edited there (seal broken or absent) -> kept, and the push says
    so; `overwrite_card=True` (`--overwrite-card`) replaces it anyway.
"Ours" is a fresh card whose snippets name the repo id, unless the model dir's README.md
is not an intact vit_hub card (edited or written by hand): then it goes up as written.

A model dir and a repo are untrusted. A push uploads the model dir's regular files and
refuses one that is a link leading out of it; a pull writes a new or empty folder (or, asked
to overwrite, replaces one whole) and only once the weights are checked against the config.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import socket
import tempfile
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import httpx2
from huggingface_hub import CommitOperationAdd, HfApi, constants, get_token, hf_hub_download, snapshot_download
from huggingface_hub.errors import (GatedRepoError, HfHubHTTPError, HFValidationError, LocalEntryNotFoundError,
                                    OfflineModeIsEnabled, RemoteEntryNotFoundError, RepositoryNotFoundError,
                                    RevisionNotFoundError)
from huggingface_hub.utils import validate_repo_id

from vit_hub.errors import UserError
from vit_hub.hub.card import is_generated_card, render_card_text
from vit_hub.layout import PUBLISHED_FILES, ExportLayout, ModelDir
from vit_hub.model.config import ViTConfig
from vit_hub.storage import check_safetensors, read_card

DEFAULT_BRANCH = "main"
LOGIN_HINT = "--token (token= in Python), HF_TOKEN or `hf auth login`"
# Which README.md a push committed.
CARD_GENERATED = "generated for the repo"
CARD_LOCAL = "the model dir's own, edited by hand"
CARD_KEPT = "kept the one edited on the Hub"


class HubError(UserError):
    """A problem with a Hub repo, the token or the connection, said in one line."""


@dataclasses.dataclass
class PushResult:
    repo_id: str
    revision: str
    commit_url: str
    files: list[str]  # paths in this commit, README.md included unless the Hub's card was kept
    card: str  # CARD_GENERATED, CARD_LOCAL or CARD_KEPT


def hub_endpoint() -> str:
    """The Hub's URL: `HF_ENDPOINT` now (huggingface_hub itself reads it once, at import)."""
    return (os.environ.get("HF_ENDPOINT") or constants.ENDPOINT).rstrip("/")


# Resolving ---------------------------------------------------------------------------------
def resolve_model_dir(reference: str | Path, revision: str | None = None, token: str | None = None,
                      with_onnx: bool = False) -> Path:
    """A model folder as it is; a repo id -> the cached snapshot holding its config and weights
    (and with `with_onnx` the ONNX files the repo has, see `vit_hub.layout`).

    The config is fetched and checked first, so a repo that is not a vit_hub model fails
    before its weights are downloaded.
    """
    path = Path(reference)
    if path.is_dir():
        check_model_dir(path, flag="--model", weights=not with_onnx)  # ONNX graphs need no weights
        return path
    if path.exists():
        raise UserError(f"--model: expected a model folder or a Hub repo id, got the file {reference}")
    repo_id = _repo_id_or_missing_folder(str(reference))
    try:
        config_path = _download(repo_id, ModelDir.config, revision, token)
    except HubError as error:  # the user may have meant a folder: say both
        raise HubError(f"--model {reference}: no such folder here, and as a Hub repo: {error}") from error
    return _fetch_after_config(repo_id, config_path, revision, token, with_onnx)


def fetch_repo(repo_id: str, revision: str | None = None, token: str | None = None) -> Path:
    """A Hub repo id -> the cached snapshot folder holding its config and weights (the config
    is checked before the weights are downloaded). Problems are one-line `HubError`s."""
    check_repo_id(repo_id)
    return _fetch_after_config(repo_id, _download(repo_id, ModelDir.config, revision, token), revision, token)


def _fetch_after_config(repo_id: str, config_path: Path, revision: str | None, token: str | None,
                        with_onnx: bool = False) -> Path:
    """Check the downloaded config, then fetch the weights (and the ONNX files there are)."""
    check_config(config_path, repo_id)
    _download(repo_id, ModelDir.weights, revision, token)
    if with_onnx:
        for path in ExportLayout.for_model(config_path.parent).onnx_files:
            _download(repo_id, path.name, revision, token, required=False)
    return config_path.parent


def pull(repo_id: str, out: str | Path, revision: str | None = None, token: str | None = None,
         overwrite: bool = False) -> Path:
    """Download every file of a vit_hub model repo into `out`, a model dir: a new or empty folder,
    or with `overwrite` one that is replaced whole (no file of the old model dir stays).

    The repo's config is checked first; the files then go to a temporary folder beside `out`,
    where the weights are checked against the config (names and shapes, from the safetensors
    header) before that folder takes `out`'s place. A pull that fails leaves `out` as it was.
    """
    check_repo_id(repo_id)
    out = Path(out)
    _check_pull_target(out, overwrite)
    check_config(_download(repo_id, ModelDir.config, revision, token), repo_id)
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.pulling-", dir=out.parent))
    try:
        with hub_errors(repo_id, revision):
            snapshot_download(repo_id, revision=revision or DEFAULT_BRANCH, local_dir=staging, token=token,
                              endpoint=hub_endpoint())
        _check_pulled(staging, repo_id)
        _replace_folder(staging, out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return out


def _check_pull_target(out: Path, overwrite: bool) -> None:
    if out.exists() and not out.is_dir():
        raise UserError(f"--out {out}: expected a folder (new or empty), found a file")
    if out.is_dir() and not overwrite and (names := sorted(path.name for path in out.iterdir())):
        shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
        raise UserError(f"--out {out}: expected a new or empty folder, found {shown} in it; --overwrite "
                         f"replaces the folder whole")


def _check_pulled(folder: Path, repo_id: str) -> None:
    """The pulled files make a model dir whose weights fit its config, or a one-line error."""
    from vit_hub.hub.weight_checks import check_weights_fit  # torch: the torch-free ONNX runtime never pulls

    pulled = ModelDir(folder)
    if not pulled.weights.is_file():
        raise HubError(f"{repo_id} is not a vit_hub model: it has no {ModelDir.weights}")
    check_weights_fit(ViTConfig.from_json(pulled.config), pulled.weights, name=f"{repo_id}'s {ModelDir.weights}")


def _replace_folder(new: Path, target: Path) -> None:
    """Move the folder `new` to `target`, a sibling; a folder already at `target` is moved aside
    first and deleted after, so `target` never holds files of both."""
    if not target.exists():
        os.rename(new, target)
        return
    old = Path(tempfile.mkdtemp(prefix=f".{target.name}.replaced-", dir=target.parent))
    os.rename(target, old)  # onto the empty folder just made
    os.rename(new, target)
    shutil.rmtree(old)


def check_model_dir(model_dir: Path, flag: str = "--model", weights: bool = True) -> None:
    """A folder with a vit_hub config.json and (unless not `weights`) model.safetensors, or a one-line error."""
    files = ModelDir(model_dir)
    if not files.config.is_file():
        raise FileNotFoundError(f"{flag}: expected {ModelDir.config} in {model_dir}, found none")
    check_config(files.config, str(model_dir))
    if not weights and not files.weights.exists():
        return
    if not files.weights.is_file():
        raise FileNotFoundError(f"{flag}: expected {ModelDir.weights} in {model_dir}, found none")
    check_safetensors(files.weights)  # a pickle or a cut file is never pushed or loaded


def check_config(path: Path, source: str) -> None:
    """config.json must describe a vit_hub model (not, say, a transformers one)."""
    try:
        ViTConfig.from_json(path)
    except UserError as error:  # not JSON, not our keys, or values out of range
        hint = ""
        if '"architecture"' in (text := path.read_text(errors="replace")) or '"model_type"' in text:
            hint = f" (a timm or transformers model? convert a ViT with: vit-hub import {source} --out DIR)"
        raise HubError(f"{source} is not a vit_hub model: {error}{hint}") from error


def check_repo_id(repo_id: str, flag: str = "repo id") -> None:
    try:
        validate_repo_id(repo_id)
    except HFValidationError:
        raise HubError(f"{flag}: expected OWNER/NAME, got {repo_id!r}") from None
    if repo_id.count("/") != 1:
        raise HubError(f"{flag}: expected OWNER/NAME, got {repo_id!r}")


def _repo_id_or_missing_folder(reference: str, flag: str = "--model") -> str:
    """`reference` names no folder here: a repo id, or a folder that does not exist."""
    looks_like_path = reference.startswith((".", "/", "~")) or reference.count("/") != 1 or "\\" in reference
    if looks_like_path:
        raise FileNotFoundError(f"{flag}: no model folder at {reference} (a Hub repo id looks like OWNER/NAME)")
    check_repo_id(reference, flag=flag)
    return reference


def fetch_file(reference: str, filename: str, revision: str | None = None, token: str | None = None,
               required: bool = True, what: str = "a vit_hub model", flag: str = "--model") -> Path | None:
    """One file of any Hub repo (vit_hub's or another library's), cached, through the same
    checks and one-line HubErrors as the rest of this module. A file the repo lacks raises
    "REPO is not `what`: it has no FILE" when `required`, else gives None. `reference` must be
    a repo id; a path that names no folder fails as `flag`'s missing folder."""
    repo_id = _repo_id_or_missing_folder(reference, flag)
    return _download(repo_id, filename, revision, token, required, what)


def has_file(repo_id: str, filename: str, revision: str | None = None, token: str | None = None) -> bool:
    """Whether the repo has `filename`, asked without downloading it."""
    with hub_errors(repo_id, revision):
        api = HfApi(endpoint=hub_endpoint(), token=token)
        return api.file_exists(repo_id, filename, revision=revision or DEFAULT_BRANCH)


def _download(repo_id: str, filename: str, revision: str | None, token: str | None,
              required: bool = True, what: str = "a vit_hub model") -> Path | None:
    """One file of the repo, cached; None for a file not `required` that the repo (or, offline,
    the cache) does not have."""
    options = dict(revision=revision or DEFAULT_BRANCH, token=token, endpoint=hub_endpoint())
    with hub_errors(repo_id, revision):
        # huggingface_hub would retry an unreachable Hub with back-off, logging a warning per try
        cache_only = not constants.is_offline_mode() and not hub_reachable(options["endpoint"])
        try:
            return Path(hf_hub_download(repo_id, filename, local_files_only=cache_only, **options))
        except (LocalEntryNotFoundError, RemoteEntryNotFoundError) as error:
            if not required:
                return None
            if isinstance(error, RemoteEntryNotFoundError):
                raise HubError(f"{repo_id} is not {what}: it has no {filename}") from None
            raise HubError(_not_cached_message(repo_id, revision, options["endpoint"])) from None


PROXY_VARIABLES = ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy")


def hub_reachable(endpoint: str, timeout: float = 5.0) -> bool:
    """Whether a TCP connection to the Hub's host opens (always True behind a proxy, which
    this check cannot see through)."""
    if any(os.environ.get(name) for name in PROXY_VARIABLES):
        return True
    url = urlsplit(endpoint)
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        with socket.create_connection((url.hostname or "", port), timeout=timeout):
            return True
    except OSError:  # refused, no route, unknown host, timed out
        return False


# Errors -------------------------------------------------------------------------------------
@contextlib.contextmanager
def hub_errors(repo_id: str, revision: str | None = None) -> Iterator[None]:
    """Turn huggingface_hub's and the network's exceptions into one-line `HubError`s."""
    endpoint = hub_endpoint()
    try:
        yield
    except GatedRepoError as error:
        raise HubError(f"{repo_id} is gated on {endpoint}: accept its terms there and use a token "
                       f"({LOGIN_HINT})") from error
    except RepositoryNotFoundError as error:
        raise HubError(f"no model repo {repo_id} on {endpoint} (check the id; a private repo needs a token: "
                       f"{LOGIN_HINT})") from error
    except RevisionNotFoundError as error:
        raise HubError(f"{repo_id} on {endpoint} has no revision {revision!r}") from error
    except LocalEntryNotFoundError as error:
        raise HubError(_not_cached_message(repo_id, revision, endpoint)) from error
    except OfflineModeIsEnabled as error:
        raise HubError(f"HF_HUB_OFFLINE is set, and this needs the Hub at {endpoint}: unset it to go online") from error
    except HfHubHTTPError as error:
        raise HubError(f"the Hub at {endpoint} refused the request for {repo_id}: {_status(error)}") from error
    except httpx2.TransportError as error:
        raise HubError(f"cannot reach the Hub at {endpoint} ({type(error).__name__}): check the network "
                       f"and HF_ENDPOINT") from error
    except HubError:
        raise
    except ValueError as error:  # huggingface_hub's own checks, e.g. README.md metadata the Hub rejects
        lines = [line.strip(" -") for line in str(error).splitlines() if line.strip(" -")]
        raise HubError(f"{repo_id}: {'; '.join(lines)}") from error


def _not_cached_message(repo_id: str, revision: str | None, endpoint: str) -> str:
    what = f"{repo_id}@{revision or DEFAULT_BRANCH}"
    if constants.is_offline_mode():
        return (f"HF_HUB_OFFLINE is set and {what} is not in the local cache ({constants.HF_HUB_CACHE}): "
                f"load it once online, or unset HF_HUB_OFFLINE")
    return f"cannot reach the Hub at {endpoint} and {what} is not in the local cache: check the network and HF_ENDPOINT"


def _status(error: HfHubHTTPError) -> str:
    """'401 Invalid credentials' from an HTTP error: its first line, never its headers."""
    status = error.response.status_code if error.response is not None else "?"
    detail = (error.server_message or str(error)).strip().splitlines()
    hint = f" (check the token's write access: {LOGIN_HINT})" if status in (401, 403) else ""
    return f"{status} {detail[0][:200] if detail else ''}".strip() + hint


# Pushing ----------------------------------------------------------------------------------
def push_to_hub(model_dir: str | Path, repo_id: str, *, private: bool | None = None, with_onnx: bool = False,
                revision: str | None = None, commit_message: str | None = None, token: str | None = None,
                overwrite_card: bool = False) -> PushResult:
    """Upload a model dir to `repo_id` in one commit; the repo (and branch) are created if needed.

    Args:
        model_dir: folder written by `vit-hub train`.
        repo_id: "OWNER/NAME".
        private: make the repo private when this push creates it (None: the Hub's default).
        with_onnx: also upload the export's files the folder holds (`ExportLayout.onnx_files`:
            the graphs but the int8 one, and the report); model.onnx must be there.
        revision: branch to commit to (default "main"); created from main if missing.
        commit_message: summary of the commit (default names the folder).
        token: Hub token; default HF_TOKEN, then the cached login.
        overwrite_card: replace a README.md that was edited on the Hub (otherwise kept).
    """
    files = files_to_push(model_dir := Path(model_dir), repo_id, with_onnx)
    api = HfApi(endpoint=hub_endpoint(), token=_push_token(token), library_name="vit_hub")
    branch = revision or DEFAULT_BRANCH
    with hub_errors(repo_id, branch):
        api.create_repo(repo_id, private=private, exist_ok=True)
        if branch != DEFAULT_BRANCH:
            api.create_branch(repo_id, branch=branch, exist_ok=True)
        card, card_source = _card_to_push(api, model_dir, repo_id, branch, with_onnx, overwrite_card)
        operations = [CommitOperationAdd(path_in_repo=name, path_or_fileobj=str(model_dir / name)) for name in files]
        if card is not None:
            operations.append(CommitOperationAdd(path_in_repo=ModelDir.card, path_or_fileobj=card.encode("utf-8")))
        commit = api.create_commit(repo_id, operations, revision=branch,
                                   commit_message=commit_message or f"Upload vit_hub model from {model_dir.name}")
    return PushResult(repo_id=repo_id, revision=branch, commit_url=commit.commit_url,
                      files=[operation.path_in_repo for operation in operations], card=card_source)


def files_to_push(model_dir: Path, repo_id: str, with_onnx: bool) -> list[str]:
    """The files a push uploads beside the card, checked as a push checks them (`push --dry-run`)."""
    names = [name for name in PUBLISHED_FILES if name != ModelDir.card] + (onnx_files(model_dir) if with_onnx else [])
    _refuse_links_out(model_dir, [*names, ModelDir.card], flag="push --model")  # the card: read, maybe sent
    check_model_dir(model_dir, flag="push --model")
    check_repo_id(repo_id, flag="--repo-id")
    return [name for name in names if (model_dir / name).is_file()]  # regular files: no FIFO, no folder


def _refuse_links_out(folder: Path, names: list[str], flag: str) -> None:
    """A one-line HubError when a named file of `folder` is a link leading out of it: a push would
    upload whatever it points to (a curves.png linked to /etc/passwd). Links inside are fine."""
    root = folder.resolve()
    for name in names:
        path = folder / name
        if path.is_symlink() and not path.resolve().is_relative_to(root):
            raise HubError(f"{flag}: expected regular files inside {folder}, found {name}, a link leading out of it "
                           f"(copy the file in, or remove the link)")


def _push_token(token: str | None) -> str:
    token = token or get_token()
    if not token:
        raise HubError(f"push needs a Hugging Face token with write access: give one with {LOGIN_HINT}")
    return token


def onnx_files(model_dir: Path) -> list[str]:
    """The ONNX files beside the weights; a HubError naming the export command when model.onnx is missing."""
    layout = ExportLayout.for_model(model_dir)
    if not layout.logits.is_file():
        raise HubError(f"--with-onnx: expected {layout.logits.name} in {model_dir}, found none; export it first: "
                       f"vit-hub export --model {model_dir} --out {model_dir} --output-attentions")
    return [path.name for path in layout.onnx_files if path.is_file()]


def _card_to_push(api: HfApi, model_dir: Path, repo_id: str, branch: str, onnx: bool,
                  overwrite: bool) -> tuple[str | None, str]:
    """(README.md text to commit or None, which card that is: CARD_GENERATED, CARD_LOCAL or CARD_KEPT)."""
    remote = None if overwrite else _remote_card(api, repo_id, branch)
    if remote is not None and not is_generated_card(remote):
        return None, CARD_KEPT
    local = ModelDir(model_dir).card
    if local.is_file() and not is_generated_card(text := read_card(local)):
        return text, CARD_LOCAL
    return render_card_text(model_dir, repo_id, onnx=onnx), CARD_GENERATED


def _remote_card(api: HfApi, repo_id: str, branch: str) -> str | None:
    """README.md on the Hub, or None when the repo has none. Downloaded outside the cache."""
    with tempfile.TemporaryDirectory() as folder:
        try:
            path = api.hf_hub_download(repo_id, ModelDir.card, revision=branch, local_dir=folder)
        except RemoteEntryNotFoundError:
            return None
        return read_card(path)
