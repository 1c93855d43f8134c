"""LoRA: the adapter is what is trained and what is synced. This module owns it: attaching a peft LoRA
to the trainer's model, its adapter-only state, each model version's adapter written as a PEFT
directory, loading it on the vLLM servers as `v{version}`, unloading versions no new request may name
and deleting their directories once no request can still be using them, the start-up check that a
server can, and the merge into a full model for serving elsewhere.

    model = attach(model, rank=8, alpha=16, targets=DEFAULT_TARGETS, base_dtype=torch.bfloat16)
    path = write_adapter(model, out_dir / "adapters", version)           # ~1 % of the weights' bytes
    for url in urls: load_adapter(url, version, path)                      # requests name "v{version}"
    for url in urls: unload_versions(url, loaded[url], oldest_in_flight)   # the dirs: AdapterSyncer's keep_s

Choices, and where they depart from the obvious:
- One name and one directory per version, never a version loaded "in place" under an old name: vLLM
  keys its prefix cache by (adapter name, adapter path) (`vllm/v1/core/kv_cache_utils.py`,
  `_gen_lora_extra_hash_keys`), so a new name and path can never be served KV computed under another
  version, and a turn that started on `v3` finishes on `v3` even after `v4` is loaded (the request
  names its adapter; nothing switches under it). In-place reloads keep the old KV (vLLM warns).
- vLLM's `/v1/unload_lora_adapter` only drops the name (the route answers 404 for it from then on); the
  weights stay in the engine's LRU cache of `--max-cpu-loras` (= `--max-loras`) adapters, which
  bounds the server's memory whatever the run's length. So nothing piles up there; unloading is what
  keeps a request from naming a version that is gone.
- A version's directory outlives its unload by the longest a request may take (`keep_s`), not by a
  number of versions: the engine reloads an adapter it evicted from its LRU from that path for a request
  it still holds (a queued or preempted one), and a path that is gone then kills the engine
  (LoRAAdapterNotFoundError in its step: EngineDeadError, the server down). A request lives at most its
  client's timeout (vLLM aborts one whose client went: `with_cancellation` on /v1/completions), and how
  many versions pass meanwhile has no bound: a group over --max-staleness is trained, not dropped.
- The adapter travels as files: the server reads the directory the trainer wrote. A server on another
  host needs the run's output directory on a shared filesystem at the same path; `check_server` loads a
  probe adapter at start-up and refuses, in one line, a server that cannot read it.
- The base is frozen and held in the compute dtype (no fp32 masters, no optimizer state for it); the
  adapter is fp32, so its AdamW state and updates are as precise as full fine-tuning's.
"""

import copy
import json
import os
import shutil
import time
import urllib.request
from collections.abc import Iterable
from contextlib import AbstractContextManager
from pathlib import Path

import torch
from peft import LoraConfig, PeftModel, get_peft_model, get_peft_model_state_dict, set_peft_model_state_dict
from safetensors import SafetensorError
from safetensors.torch import load_file
from torch.distributed.tensor import DTensor

from checkpoint import not_written
from vllm_server import vllm_max_lora_rank
from weight_sync import HTTPStatusError, WeightSyncer, WeightSyncError, _reset_kv, post

# Every linear layer of attention and MLP in Qwen2/Qwen3/Llama: what `--lora-targets` defaults to, and
# the modules vLLM serves LoRA on for these models (it packs q/k/v and gate/up; an adapter on a subset
# of a packed group is padded with zeros there).
DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


# ---------------------------------------------------------------------------------------------------
# THE TRAINER'S SIDE: attach, adapter-only state, write a version, merge
# ---------------------------------------------------------------------------------------------------
def attach(
    model: torch.nn.Module, rank: int, alpha: float, targets: Iterable[str], base_dtype: torch.dtype
) -> PeftModel:
    """`model` with a fresh LoRA adapter (A random, B zero: the adapted model starts as the base). The
    base is frozen and cast to `base_dtype`; the adapter's weights are fp32 whatever the base's."""
    model.to(base_dtype).requires_grad_(False)
    config = LoraConfig(
        r=rank, lora_alpha=alpha, target_modules=list(targets), lora_dropout=0.0, bias="none",
        task_type="CAUSAL_LM",
    )  # fmt: skip
    peft_model = get_peft_model(model, config)
    # adapter_config.json names the base: a local directory by its absolute path, or merge_lora.py run
    # from another directory looks the relative --model up there (on the hub, or a same-named other dir).
    base = peft_model.peft_config["default"].base_model_name_or_path
    if base and os.path.isdir(base):
        peft_model.peft_config["default"].base_model_name_or_path = os.path.abspath(base)
    # peft upcasts 16-bit adapters to fp32 itself (autocast_adapter_dtype); this also covers a base in
    # another dtype and states the rule where it is relied on.
    for p in adapter_parameters(peft_model):
        p.data = p.data.float()
    return peft_model


def attach_for_training(model: torch.nn.Module, args, ckpt: Path | None) -> PeftModel:
    """trainer.load_models with `--lora-rank`: the adapter of --lora-rank/--lora-alpha/--lora-targets on
    the base frozen in --compute-dtype, and a resumed checkpoint's adapter read into it. Under FSDP
    (distributed.load_sharded) rank 0 attaches to the loaded base, every rank to a meta skeleton (no
    `ckpt`: its shards come from rank 0's copy), then the base and the adapter are sharded together:
    FSDP2 gathers a layer's frozen bf16 base and fp32 adapter in one go and reduce-scatters the
    adapter's gradients alone (it needs one dtype only among the trained parameters of a group)."""
    base_dtype = torch.bfloat16 if args.compute_dtype == "bf16" else torch.float32
    alpha = args.lora_alpha or 2 * args.lora_rank
    model = attach(model, args.lora_rank, alpha, args.lora_targets.split(","), base_dtype)
    if ckpt is not None:
        read_adapter(model, ckpt)
    return model


def args_problem(args) -> str | None:
    """None when --lora-rank/--lora-alpha/--lora-targets can be trained on --model (its config read, no
    weights loaded), else the flag's one line: check_args's LoRA checks."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if not 0 <= args.lora_rank <= 512 or args.lora_alpha < 0:
        return f"--lora-rank must be in 0..512 and --lora-alpha ≥ 0, got {args.lora_rank}, {args.lora_alpha}"
    if args.lora_rank == 0:
        return None
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(args.model))
    linear = {n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    # The logprob head (sampling.py) multiplies by the output layer's base weight: an adapter there
    # would never be trained, and its optimizer state would be missing at a resume.
    out = model.get_output_embeddings()
    head = next((n.rsplit(".", 1)[-1] for n, m in model.named_modules() if m is out), None)
    linear.discard(head)
    missing = [t for t in args.lora_targets.split(",") if t not in linear]
    if head in missing:
        return f"--lora-targets: {head} is the output layer, which the logprob head reads without an adapter"
    if missing:
        return f"--lora-targets: {', '.join(missing)} not linear layers of {args.model} ({sorted(linear)})"
    return None


def adapter_parameters(model: PeftModel) -> list[torch.nn.Parameter]:
    """The trained parameters: the only ones the optimizer holds."""
    return [p for p in model.parameters() if p.requires_grad]


def whole_adapter(model: PeftModel) -> dict[str, torch.Tensor]:
    """The adapter's weights, keyed as model.state_dict() keys them, each whole: under FSDP gathered
    from the ranks' shards one tensor at a time (a few MB), so every rank calls this together (the
    other ranks when rank 0 writes a version: trainer.follow_rank0); the base is never gathered."""
    return {
        n: (p.full_tensor() if isinstance(p, DTensor) else p).detach()
        for n, p in model.named_parameters()
        if p.requires_grad
    }


def adapter_state(model: PeftModel) -> dict[str, torch.Tensor]:
    """The adapter alone, keyed as PEFT saves it (`…q_proj.lora_A.weight`): what checkpoints and syncs
    carry. `set_peft_model_state_dict(model, state)` puts it back. Under FSDP: every rank together
    (whole_adapter)."""
    return {k: v.detach() for k, v in get_peft_model_state_dict(model, whole_adapter(model)).items()}


def reference(model: PeftModel) -> AbstractContextManager:
    """`with reference(model):` the model computes as the frozen base: --kl-beta's reference with LoRA,
    without a second copy of the model (peft's disable_adapter; gradients do not reach the adapter)."""
    return model.disable_adapter()


def adapter_name(version: int) -> str:
    """The adapter's name on the servers: what a request's `model` field says to be sampled by it."""
    return f"v{version}"


def adapter_version(name: str) -> int | None:
    """The version `adapter_name` gave `name` (an adapter on a server, its directory); None for a name
    it never gives."""
    digits = name[1:]
    if digits.isascii() and digits.isdigit() and adapter_name(int(digits)) == name:
        return int(digits)
    return None


def write_adapter(
    model: PeftModel, root: Path, version: int, weights: dict[str, torch.Tensor] | None = None
) -> Path:
    """Write `version`'s adapter as a PEFT directory (adapter_config.json + adapter_model.safetensors)
    at root/v{version}, the path the servers load it from. Written to a temp dir and renamed: a server
    never reads half a file. `weights`: whole_adapter(model)'s, when the caller has them (under FSDP
    every rank gathers them, rank 0 writes); else gathered here."""
    path = Path(root) / adapter_name(version)
    tmp = path.with_name(path.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        model.save_pretrained(tmp, state_dict=whole_adapter(model) if weights is None else weights)
    except (OSError, SafetensorError) as e:  # a full disk: dirs stay keep_s after their unload (docs/lora.md)
        shutil.rmtree(tmp, ignore_errors=True)
        raise not_written("adapter", path, e, f"the older versions under {root} can go") from e
    (tmp / "README.md").unlink(missing_ok=True)  # peft's model card: no server reads it
    shutil.rmtree(path, ignore_errors=True)  # a resumed run rewrites the versions after its checkpoint
    os.replace(tmp, path)
    return path


def read_adapter(model: PeftModel, path: Path) -> None:
    """Put the adapter written at `path` (by write_adapter, or a checkpoint's) into `model`, which has
    the same rank and targets: what a resume does. ValueError for a key the model has no place for or a
    LoRA weight the file lacks (another rank or targets)."""
    state = load_file(Path(path) / "adapter_model.safetensors")
    result = set_peft_model_state_dict(model, state)
    missing = [k for k in result.missing_keys if ".lora_" in k]  # the base's keys are never in the file
    if result.unexpected_keys or missing:
        raise ValueError(f"adapter {path} does not fit the model: {(result.unexpected_keys or missing)[:3]}")


def adapter_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in Path(path).iterdir())


def remove_dirs(root: Path, keep_from: int) -> None:
    """Delete the adapter directories of versions below `keep_from`: only versions no request in flight
    names (unloading is not enough: the engine reloads an adapter it evicted from its LRU from this path
    while a request still uses it, vllm/lora/worker_manager.py)."""
    for d in Path(root).glob("v*"):
        version = adapter_version(d.name)
        if version is not None and version < keep_from:
            shutil.rmtree(d, ignore_errors=True)


def merge(model: PeftModel) -> torch.nn.Module:
    """A full model with the adapter folded into the base weights (W + α/r · B A), in fp32 whatever the
    base's dtype, for serving without LoRA. `model` itself is left as it is."""
    merged = copy.deepcopy(model).float()
    return merged.merge_and_unload()


# ---------------------------------------------------------------------------------------------------
# THE SERVERS' SIDE: load a version, unload the ones no request uses, the start-up check
# ---------------------------------------------------------------------------------------------------
class LoRAServerError(RuntimeError):
    def __init__(self, message: str, status: int | None = None):
        super().__init__(message)
        self.status = status  # the HTTP status, None when no answer came


def _post(url: str, route: str, body: dict, timeout_s: float) -> None:
    """weight_sync.post; LoRAServerError with vLLM's own message (one line) and the status when it
    refuses, without a status when no answer came."""
    try:
        post(url, route, body, timeout_s)
    except HTTPStatusError as e:
        detail = e.text
        try:  # vLLM's errors: {"error": {"message"}}; a route that is not there: FastAPI's {"detail"}
            answer = json.loads(detail)
            detail = answer["error"]["message"] if "error" in answer else answer["detail"]
        except (ValueError, KeyError, TypeError):
            pass
        one_line = " ".join(str(detail).split())[:400]
        raise LoRAServerError(f"{route}: {e.status} {one_line}", e.status) from None
    except OSError as e:
        raise LoRAServerError(f"{route}: {e}") from None


def load_adapter(url: str, version: int, path: Path, timeout_s: float = 120.0, inplace: bool = False) -> None:
    """Load `version`'s adapter on the server at `url` as `v{version}`; from then on a request naming
    it is sampled by it. The server reads `path` itself (vLLM's runtime LoRA route). `inplace`: over
    what the server holds under that name (its cached KV is not dropped: reset_kv)."""
    body = {"lora_name": adapter_name(version), "lora_path": str(Path(path).resolve())}
    _post(url, "/v1/load_lora_adapter", body | ({"load_inplace": True} if inplace else {}), timeout_s)


def reset_kv(url: str, timeout_s: float = 30.0) -> None:
    """Drop the server's cached KV (running requests' too: they are recomputed). vLLM keys it by an
    adapter's (name, path), so an adapter loaded again under both is otherwise served the KV of the
    one it replaced (test_the_prefix_cache_is_keyed_by_adapter_and_an_in_place_reload_is_not)."""
    _reset_kv(url, "/reset_prefix_cache?reset_running_requests=true", None, timeout_s)


def unload_adapter(url: str, version: int, timeout_s: float = 30.0) -> None:
    _post(url, "/v1/unload_lora_adapter", {"lora_name": adapter_name(version)}, timeout_s)


def unload_versions(url: str, loaded: set[int], keep_from: int) -> list[int]:
    """Unload from the server at `url` each version in `loaded` below `keep_from` (the oldest version
    any request in flight names), removing it from `loaded`; returns those unloaded. One the server does
    not hold (404: it restarted since the syncer last looked) is as good as unloaded."""
    gone = sorted(v for v in loaded if v < keep_from)
    for v in gone:
        try:
            unload_adapter(url, v)
        except LoRAServerError as e:
            if e.status != 404:
                raise
        loaded.discard(v)
    return gone


def served_adapters(url: str) -> list[str]:
    """The adapter names the server answers to (its /v1/models, less the base model)."""
    with urllib.request.urlopen(f"{url}/v1/models", timeout=10) as r:
        return [m["id"] for m in json.loads(r.read())["data"] if m.get("parent")]


PROBE_NAME = "lora-probe"


def check_server(url: str, probe_path: Path, rank: int) -> None:
    """Refuse (LoRAServerError, one line) a server that cannot serve this run's adapters: started
    without the runtime adapter routes, without LoRA, with a smaller `--max-lora-rank`, or unable to
    read the trainer's adapter directory (another host without the run's output dir at the same path).
    Loads the adapter at `probe_path` under a name of its own and unloads it. In place: a run killed
    between the two (or whose unload timed out) left the probe loaded, and vLLM refuses a name it holds."""
    body = {"lora_name": PROBE_NAME, "lora_path": str(Path(probe_path).resolve()), "load_inplace": True}
    try:
        _post(url, "/v1/load_lora_adapter", body, 120.0)
        _post(url, "/v1/unload_lora_adapter", {"lora_name": PROBE_NAME}, 30.0)
    except LoRAServerError as e:
        flags = f"`--enable-lora --max-lora-rank {vllm_max_lora_rank(rank)}`"
        if str(e).endswith(" 404 Not Found"):  # FastAPI's answer: vLLM adds the route only with the variable
            why = (
                f"has no runtime LoRA routes: start it with VLLM_ALLOW_RUNTIME_LORA_UPDATING=True and {flags}"
            )
        else:
            why = (
                f"cannot load the trainer's adapter ({e}): it needs {flags} and the run's output dir "
                "readable at the same path (a server on another host: a shared filesystem)"
            )
        raise LoRAServerError(f"--lora-rank {rank}: vLLM server {url} {why}", e.status) from None


# ---------------------------------------------------------------------------------------------------
# THE SYNC: each version's adapter loaded on every server under its own name, no weights sent
# ---------------------------------------------------------------------------------------------------
# How long the engine may take to drop a request whose client gave up, on top of the client's own timeout;
# also at least the per-sync check's request timeout (fidelity.PROBE_TIMEOUT_S, 60 s, asserted in
# tests/test_lora.py), so a --batch-timeout below that is covered too.
ABORT_MARGIN_S = 60.0


class AdapterSyncer(WeightSyncer):
    """The weight sync of a LoRA run, with WeightSyncer's per-server state (`urls`, `failed`,
    `taken_out`, `version`, out_of_step / rejoin / take_out: a server that fails or restarts is handled
    as in a full-weight run) but no transfer group: `groups` maps each joined server to the versions
    loaded there. A sync writes the adapter (`write_adapter`), loads it as `v{version}` on each server,
    sets the server's weight-version tag (what the rollout client and `out_of_step` read), and unloads
    versions below the previous one: a turn that read the version just before the sync may still send
    a request naming it; a request already sent keeps its adapter through the unload (docs/lora.md).
    No pause and no KV reset: a new name never shares cached KV with another version. A version's
    directory goes `keep_s` (the clients' `request_timeout_s` + ABORT_MARGIN_S) after no joined server
    holds it any more: the engine reloads an adapter it evicted from its LRU from its path for a request
    it still holds, and dies if the path is gone (module docstring); a request sent before the unload is
    aborted by then, one sent after is refused by name (404: its group restarts). The current version's
    and every loaded one's stay, and directories an earlier run left (a resume rewrites those it reaches)
    go `keep_s` after the first sync sees them. Without `request_timeout_s` every directory stays. Under
    FSDP it runs on rank 0, and each sync gathers the adapter with the other ranks (whole_adapter: they
    join it from trainer.follow_rank0), heal or not."""

    def __init__(
        self, urls: list[str], model: PeftModel, root: Path, rank: int, request_timeout_s: float | None = None
    ):
        super().__init__(urls, http_timeout_s=120.0)
        self.model, self.root, self.lora_rank = model, Path(root), rank
        # request_timeout_s: the longest a request naming an adapter may wait (--batch-timeout: rollouts
        # and eval); None keeps every directory
        self.keep_s = None if request_timeout_s is None else request_timeout_s + ABORT_MARGIN_S
        self.unheld_since: dict[int, float] = {}  # version → monotonic time no joined server held it from

    def init(self) -> None:
        """`check_server` for every server (LoRAServerError, one line, for one that cannot), then join.
        The versions an earlier run left loaded on a server are unloaded first (a killed run cannot
        unload its own): this run's `v{n}` names would be refused as loaded already, or a resumed run
        would meet the killed run's later versions under the names of its own."""
        shutil.rmtree(self.root / PROBE_NAME, ignore_errors=True)
        # the probe is a zero adapter of the run's shapes (no gather: the other ranks are not in this)
        zeros = {n: torch.zeros(p.shape) for n, p in self.model.named_parameters() if p.requires_grad}
        probe = write_adapter(self.model, self.root, 0, zeros).rename(self.root / PROBE_NAME)  # no version's
        for url in self.urls:
            check_server(url, probe, self.lora_rank)
            left = [v for v in map(adapter_version, served_adapters(url)) if v is not None]
            for version in left:
                unload_adapter(url, version, self.http_timeout_s)
            if left:  # a resumed run rewrites their directories: its v{n} would meet their cached KV
                reset_kv(url, self.http_timeout_s)
        shutil.rmtree(probe)
        self.join(self.urls)

    def join(self, urls: list[str]) -> None:
        """The versions each server holds: none once restarted; those it kept if it only failed a sync
        (loading one again by name is refused, and those left out would never be unloaded)."""
        for u in urls:
            try:
                held = {adapter_version(name) for name in served_adapters(u)} - {None}
            except Exception:  # noqa: BLE001 - not answering: it holds nothing we can use
                held = set()
            self.groups[u] = held

    def _release(self, urls: list[str]) -> None:
        for u in urls:
            self.groups.pop(u, None)

    def close(self) -> None:
        self.groups.clear()

    def sync(self, named_params, version: int, urls: list[str] | None = None) -> dict:
        """`named_params` is not read (the adapter is the model's); otherwise WeightSyncer.sync's contract:
        sync/ metrics, WeightSyncError naming each server that failed (the others got the version)."""
        t0 = time.perf_counter()
        path = self.root / adapter_name(version)
        weights = whole_adapter(self.model)  # FSDP: the other ranks are in these gathers, heal or not
        if urls is None or not path.exists():  # a heal re-loads the version the others have
            path = write_adapter(self.model, self.root, version, weights)
        failed: dict[str, str] = {}
        targets = [u for u in (urls or self.urls) if u in self.groups]
        for u in targets:
            try:
                # A subset sync (heal; the per-sync check's re-sync of a server found out of step) makes
                # the server hold our adapter whatever it holds under the name: loaded again, in place.
                again = urls is not None and version in self.groups[u]
                if again or version not in self.groups[u]:
                    load_adapter(u, version, path, inplace=again)
                    self.groups[u].add(version)
                if again:
                    reset_kv(u, self.http_timeout_s)
                post(u, "/update_weight_version", {"new_version": str(version)}, self.http_timeout_s)
                unload_versions(u, self.groups[u], version - 1)
                self.reached(u)
            except Exception as e:  # noqa: BLE001 - dead, refusing, or silent: named below, healed later
                failed[u] = str(e)
        self.version = version
        self.failed.update(failed)
        self.remove_unheld_dirs()
        if failed or not targets:
            detail = "; ".join(f"{u}: {m}" for u, m in failed.items()) or "no server joined"
            raise WeightSyncError(f"adapter sync to version {version} failed ({detail})")
        seconds, mb = time.perf_counter() - t0, adapter_bytes(path) * len(targets) / 1e6
        return {"sync/seconds": seconds, "sync/mb": mb, "sync/mb_per_s": mb / seconds, "sync/adapter": 1.0}

    def remove_unheld_dirs(self) -> list[int]:
        """Delete the directory of each version that no joined server has held for `keep_s` (the
        current version's never: a heal loads it); returns those deleted. A failed server still holds
        what it held; one taken out had its requests aborted (WeightSyncer.take_out)."""
        if self.keep_s is None:
            return []
        held = set().union(*self.groups.values(), {self.version})
        now = time.monotonic()
        on_disk = {v for v in map(adapter_version, (d.name for d in self.root.glob("v*"))) if v is not None}
        self.unheld_since = {v: self.unheld_since.get(v, now) for v in on_disk - held}
        gone = sorted(v for v, since in self.unheld_since.items() if now - since >= self.keep_s)
        for v in gone:
            shutil.rmtree(self.root / adapter_name(v), ignore_errors=True)
            del self.unheld_since[v]
        return gone
