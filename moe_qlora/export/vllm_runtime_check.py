"""Load a `--format vllm` adapter through vLLM's own LoRA path on the CPU and compare what it would add with PEFT.

A script run under vLLM's Python (not the project's: it imports nothing of moe_qlora, and vllm only inside its
functions, so that the package imports it without vLLM), with VLLM_TARGET_DEVICE=cpu; `moe-qlora verify` and
tests/export/test_vllm_oracle.py run it:

    $VLLM_PYTHON moe_qlora/export/vllm_runtime_check.py JOB.json

JOB.json: {"cases": [{"name", "base", "lora", "merged", "rank"}], "out": path}. `base` is a tiny HF checkpoint,
`lora` the adapter folder the export wrote for vLLM, `merged` the same base with PEFT's merge_and_unload of the
adapter applied in fp32 (the oracle). For each case, one after another in this process, vLLM loads `base` with
LoRA enabled (EngineArgs -> VllmConfig, get_model, WorkerLoRAManager.create_lora_manager, which wraps the
modules; _load_adapter, which runs PEFTHelper, LoRAModel.from_local_checkpoint and _validate_moe_lora_format;
add_adapter, which packs and folds alpha/r into lora_b; activate_adapter, which copies into the wrappers' stacked
buffers), then `merged` without LoRA. Generation does not run on the CPU build (its custom ops are missing), so
the check is on weights: per wrapped module, vLLM's base weight plus the delta rebuilt from the wrapper's stacked
buffers for the activated slot (what the kernels add at runtime) against vLLM's own load of the merged
checkpoint, in vLLM's layout. Two broken controls must fail: MoE deltas rolled by one expert, and the first
module's delta dropped. Besides, it lists LoRA weights that landed in no wrapper (leftover), wrapped layers given
a LoRA that the model can still reach without their wrapper (bypassed: loaded, never applied there; those given
none go to bypassed_untrained: targets that would be bypassed if trained), and parameters PEFT's merge changed
that no vLLM LoRA module covers (uncovered; a parameter the checkpoint lacks, left uninitialised by vLLM, shows
there too).

`out` receives a JSON list, one object per case: name, vllm, loaded_tensors, wrapped_modules, leftover,
bypassed, bypassed_untrained, uncovered, modules_checked, max_err, worst (its module.parameter), rolled_err,
dropped_err, seconds, error (null, or the exception's last line; the case's other fields are then partial).
"""

from __future__ import annotations

import gc
import json
import os
import sys
import time
import traceback
from pathlib import Path

import torch
from torch import nn

LORA_ID = 1
MAX_MODEL_LEN = 64
# vLLM's LoRAConfig.max_lora_rank accepts these only (config/lora.py, MaxLoRARanks)
ALLOWED_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


# --- vLLM global state ----------------------------------------------------------------------------------------


def init_vllm_distributed(vllm_config) -> None:
    """World size 1 on gloo: the parallel linear layers and the MoE runner ask vLLM's tensor/expert-parallel
    groups for their rank and size while they are built, so the groups must exist before get_model. Once per
    process (the groups outlive the cases); initialize_model_parallel reads the current VllmConfig."""
    from vllm.config import set_current_vllm_config
    from vllm.distributed import parallel_state

    if parallel_state.model_parallel_is_initialized():
        return
    import socket

    with socket.socket() as s:  # a free local port for the one-rank TCP store
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    parallel_state.init_distributed_environment(
        world_size=1, rank=0, distributed_init_method=f"tcp://127.0.0.1:{port}", local_rank=0, backend="gloo"
    )
    with set_current_vllm_config(vllm_config):
        parallel_state.ensure_model_parallel_initialized(1, 1)


def engine_config(model_dir: str, rank: int | None):
    """vLLM's VllmConfig for a tiny checkpoint, as `vllm serve` would build it: fp32 (the oracle is fp32), eager,
    a short context; LoRA enabled with one slot when `rank` is given (max_lora_rank: vLLM's smallest allowed
    rank that holds it)."""
    from vllm.engine.arg_utils import EngineArgs

    lora = {}
    if rank is not None:
        max_rank = next(r for r in ALLOWED_RANKS if r >= rank)
        lora = {"enable_lora": True, "max_lora_rank": max_rank, "max_loras": 1, "max_cpu_loras": 1}
    args = EngineArgs(
        model=model_dir,
        dtype="float32",
        max_model_len=MAX_MODEL_LEN,
        enforce_eager=True,
        max_num_seqs=1,
        max_num_batched_tokens=MAX_MODEL_LEN,
        trust_remote_code=False,
        **lora,
    )
    return args.create_engine_config()


def load_vllm_model(vllm_config) -> nn.Module:
    """vLLM's model class built and filled by its own weight loader (model_loader.get_model), under the config
    context the layers read while they are built (as the CPU model runner's load_model does)."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader import get_model

    with set_current_vllm_config(vllm_config):
        return get_model(vllm_config=vllm_config)


def attach_lora(model: nn.Module, vllm_config, lora_dir: str):
    """(model with LoRA wrappers, the LoRAModelManager, the LoRAModel) through the worker's path: the LRU worker
    manager wraps the supported modules (create_lora_manager), _load_adapter reads and validates the folder,
    add_adapter packs (qkv, gate_up, the experts' w13) and folds the scaling into lora_b, activate_adapter
    copies into the wrappers' stacked buffers for a slot."""
    from vllm.config import set_current_vllm_config
    from vllm.lora.request import LoRARequest
    from vllm.lora.worker_manager import LRUCacheWorkerLoRAManager

    with set_current_vllm_config(vllm_config):
        worker = LRUCacheWorkerLoRAManager(vllm_config, torch.device("cpu"), model.embedding_modules)
        model = worker.create_lora_manager(model, vllm_config)
        manager = worker._adapter_manager
        lora = worker._load_adapter(LoRARequest("case", LORA_ID, lora_dir))
        manager.add_adapter(lora)
        manager.activate_adapter(lora.id)
    return model, manager, lora


# --- what vLLM will add ---------------------------------------------------------------------------------------


def linear_delta(wrapper, slot: int) -> torch.Tensor:
    """(out, in) delta of a linear wrapper: each slice's B A, stacked along the output rows in slice order
    (qkv_proj: q, k, v; gate_up_proj: gate, up), as punica's add_lora_linear writes them (output_slices)."""
    parts = []
    for a, b, size in zip(wrapper.lora_a_stacked, wrapper.lora_b_stacked, wrapper.output_slices, strict=True):
        part = b[slot, 0].float() @ a[slot, 0].float()
        assert part.shape[0] == size, (part.shape, size)
        parts.append(part)
    return torch.cat(parts, dim=0)


def moe_deltas(wrapper, slot: int) -> dict[str, torch.Tensor]:
    """{"w13_weight": (E, 2I, H), "w2_weight": (E, H, I)} from a MoE wrapper's stacked buffers. 2D wrappers
    (FusedMoEWithLoRA) hold gate and up as two slices that the expand kernel writes to the halves of the w13
    output, or to its even/odd channels under SwiGLU-OAI (lora_experts_mixin.apply_w13_lora); the fused 3D
    wrapper holds one slice in the base's own w13 order."""
    from vllm.model_executor.layers.fused_moe.activation import MoEActivation

    def per_expert(a, b):
        return torch.einsum("eor,eri->eoi", b[slot].float(), a[slot].float())

    slices = [per_expert(a, b) for a, b in zip(wrapper.w13_lora_a_stacked, wrapper.w13_lora_b_stacked, strict=True)]
    if len(slices) == 2 and wrapper.moe_config.activation == MoEActivation.SWIGLUOAI:
        w13 = torch.stack(slices, dim=2).flatten(1, 2)  # gate on even rows, up on odd
    else:
        w13 = torch.cat(slices, dim=1)
    w2 = per_expert(wrapper.w2_lora_a_stacked[0], wrapper.w2_lora_b_stacked[0])
    return {"w13_weight": w13, "w2_weight": w2}


def module_deltas(manager, lora) -> dict[str, dict[str, torch.Tensor]]:
    """{wrapped module path: {parameter path under that module: delta in vLLM's layout}} for every wrapper that
    was given a LoRA for the activated slot. MoE parameters live on the runner's routed experts."""
    from vllm.lora.layers import FusedMoEWithLoRA
    from vllm.lora.layers.base_linear import BaseLinearLayerWithLoRA

    slot = manager.lora_index_to_id.index(lora.id)
    out = {}
    for name, wrapper in manager.modules.items():
        if not wrapper_has_lora(manager, lora, name):
            continue
        if isinstance(wrapper, FusedMoEWithLoRA):
            out[name] = {f"routed_experts.{k}": v for k, v in moe_deltas(wrapper, slot).items()}
        elif isinstance(wrapper, BaseLinearLayerWithLoRA):
            out[name] = {"weight": linear_delta(wrapper, slot)}
        else:
            raise NotImplementedError(f"{name}: no delta rebuilt for {type(wrapper).__name__}")
    return out


def wrapper_has_lora(manager, lora, name: str) -> bool:
    """Whether activate_adapter gave the wrapper at `name` a LoRA (set_lora) rather than resetting it."""
    return manager._get_lora_layer_weights(lora, name) is not None


# --- coverage: leftover, bypassed, uncovered --------------------------------------------------------------------


def leftover_loras(manager, lora) -> list[str]:
    """LoRA module names in the loaded (packed) LoRAModel that no wrapper takes: loaded, then never applied."""
    used = set()
    for name in manager.modules:
        weights = manager._get_lora_layer_weights(lora, name)
        if weights is not None:
            used.add(id(weights))
    return sorted(k for k, v in lora.loras.items() if id(v) not in used)


def _attribute_refs(module: nn.Module, depth: int = 3):
    """(attribute path, object) of what a module holds outside its registered submodules, parameters and buffers:
    plain attributes, and lists, tuples, dicts, sets and partials of them, `depth` levels deep. A layer kept there
    is called by the module's forward without appearing in named_modules."""
    import functools

    skip = {"_modules", "_parameters", "_buffers", "_forward_hooks", "_forward_pre_hooks", "_backward_hooks"}
    stack = [(k, v, depth) for k, v in vars(module).items() if k not in skip]
    while stack:
        path, obj, left = stack.pop()
        yield path, obj
        if left == 0 or isinstance(obj, (torch.Tensor, nn.Module, str, bytes, int, float)):
            continue
        if isinstance(obj, (list, tuple, set, frozenset)):
            stack += [(f"{path}[{i}]", v, left - 1) for i, v in enumerate(obj)]
        elif isinstance(obj, dict):
            stack += [(f"{path}[{k!r}]", v, left - 1) for k, v in obj.items()]
        elif isinstance(obj, functools.partial):
            stack += [(f"{path}.args[{i}]", v, left - 1) for i, v in enumerate(obj.args)]
            stack.append((f"{path}.func", obj.func, left - 1))
        elif hasattr(obj, "__self__") and isinstance(obj.__self__, nn.Module):  # a bound method of a layer
            stack.append((f"{path}.__self__", obj.__self__, left - 1))


def _storage(t: torch.Tensor) -> int:
    """Identity of a tensor's memory: a view or an alias of a weight shares it."""
    return t.untyped_storage().data_ptr()


def unwrapped_paths(model: nn.Module, manager) -> dict[str, list[str]]:
    """{wrapped module: [where the model still holds its layer, or its weight, unwrapped]}. The LoRA wrapper
    replaces the layer under the one path the manager wrapped, but another registered path (named_modules with
    duplicates), a plain attribute, or another module's parameter, buffer or attribute sharing the weight's
    memory can hold the same layer unwrapped, and a forward through that one skips the LoRA (vLLM's qwen2_moe
    keeps mlp.shared_expert_gate as mlp.shared_expert.expert_gate too, a registered submodule of the shared
    expert). The only allowed holders are the wrapper and its base_layer. MoE wrappers are left out: they put
    their LoRA into the runner's own kernel (FusedMoEModularMethod), so the runner applies it whichever path
    calls it. A weight copied at load or at the first forward (a fused or absorbed matrix) is not seen."""
    from vllm.lora.layers import FusedMoEWithLoRA

    linear = {name: w for name, w in manager.modules.items() if not isinstance(w, FusedMoEWithLoRA)}
    layers = {id(w.base_layer): name for name, w in linear.items()}
    # the weight the LoRA is added to: a router's other parameters (e_score_correction_bias) are shared with the
    # runner by design, and reading them elsewhere bypasses nothing
    weights = {_storage(w.base_layer.weight): name for name, w in linear.items() if hasattr(w.base_layer, "weight")}
    owners = {name: {id(w), id(w.base_layer)} for name, w in linear.items()}
    found: dict[str, set[str]] = {}

    def flag(name: str, holder: nn.Module, where: str) -> None:
        if id(holder) not in owners[name]:
            found.setdefault(name, set()).add(where)

    modules = list(model.named_modules(remove_duplicate=False))
    parents = {path: module for path, module in modules}
    for path, module in modules:
        if id(module) in layers:
            flag(layers[id(module)], parents[path.rpartition(".")[0]], path)
        for pname, t in [*module._parameters.items(), *module._buffers.items()]:
            if t is not None and _storage(t) in weights:
                flag(weights[_storage(t)], module, f"{path}.{pname} (its weight)")
    for path, module in model.named_modules():
        for attr, obj in _attribute_refs(module):
            if id(obj) in layers:
                flag(layers[id(obj)], module, f"{path}.{attr} (attribute)")
            elif isinstance(obj, torch.Tensor) and obj.numel() and _storage(obj) in weights:
                flag(weights[_storage(obj)], module, f"{path}.{attr} (attribute, its weight)")
    return {name: sorted(paths) for name, paths in sorted(found.items())}


# --- comparison -------------------------------------------------------------------------------------------------


def relative_error(base: torch.Tensor, delta: torch.Tensor, merged: torch.Tensor) -> float:
    """max |base + delta - merged| / max |merged - base|: the mismatch on the scale of the oracle's delta."""
    scale = (merged - base).abs().max().item()
    if scale == 0.0:
        scale = delta.abs().max().item() or 1.0
    return ((base + delta - merged).abs().max() / scale).item()


def module_errors(base_model, merged_model, deltas: dict, *, roll: bool = False, drop_first: bool = False):
    """{"module.parameter": relative_error} with vLLM's parameters of `base_model` (the LoRA model: the
    wrapper's base_layer) and `merged_model` (no LoRA) under the same module path. `roll` moves each MoE
    module's deltas to the next expert, `drop_first` zeroes the first module's: the broken controls."""
    errors = {}
    for i, (name, params) in enumerate(deltas.items()):
        base_mod = base_model.get_submodule(name).base_layer
        merged_mod = merged_model.get_submodule(name)
        for pname, delta in params.items():
            if roll and pname.startswith("routed_experts."):
                delta = delta.roll(1, dims=0)
            if drop_first and i == 0:
                delta = torch.zeros_like(delta)
            base = base_mod.get_parameter(pname).detach().float()
            merged = merged_mod.get_parameter(pname).detach().float()
            if base.shape != delta.shape:
                raise ValueError(f"{name}.{pname}: vLLM's weight is {tuple(base.shape)}, its LoRA {tuple(delta.shape)}")
            errors[f"{name}.{pname}"] = relative_error(base, delta, merged)
    return errors


def uncovered_params(base_model, merged_model, deltas: dict) -> list[str]:
    """vLLM parameters where the merged checkpoint differs from the base but no module with a LoRA covers them:
    PEFT's merge changed something vLLM's LoRA path never adds (a target it neither wraps nor loads)."""
    covered = {f"{name}.base_layer.{p}" for name, params in deltas.items() for p in params}
    covered |= {f"{name}.{p}" for name, params in deltas.items() for p in params}
    merged = dict(merged_model.named_parameters())
    out = []
    for pname, param in base_model.named_parameters():
        plain = pname.replace(".base_layer.", ".")
        if pname in covered or plain not in merged or merged[plain].shape != param.shape:
            continue
        if not torch.equal(param.detach().float(), merged[plain].detach().float()):
            out.append(plain)
    return sorted(out)


# --- one case -------------------------------------------------------------------------------------------------


def count_lora_tensors(lora_dir: str) -> int:
    """Tensors in the adapter file (what the export wrote)."""
    from safetensors import safe_open

    with safe_open(str(Path(lora_dir) / "adapter_model.safetensors"), framework="pt") as f:
        return len(list(f.keys()))


def error_line(exc: BaseException) -> str:
    """The traceback's last line, on one line (pydantic's span several), with the raising frame when the
    exception says nothing (a bare assert)."""
    text = " ".join(" ".join(traceback.format_exception_only(exc)).split())
    if not str(exc) and exc.__traceback__ is not None:
        frame = traceback.extract_tb(exc.__traceback__)[-1]
        text += f" at {frame.filename.rpartition('site-packages/')[2]}:{frame.lineno} ({frame.line})"
    return text[:500]


def run_case(case: dict) -> dict:
    """One case's result object: load base with the LoRA, then merged without, compare, free both."""
    import vllm

    result = {"name": case["name"], "vllm": vllm.__version__, "error": None}
    start = time.monotonic()
    try:
        result["loaded_tensors"] = count_lora_tensors(case["lora"])
        lora_config = engine_config(case["base"], int(case["rank"]))
        init_vllm_distributed(lora_config)
        model, manager, lora = attach_lora(load_vllm_model(lora_config), lora_config, case["lora"])
        deltas = module_deltas(manager, lora)
        result["wrapped_modules"] = sorted(deltas)
        result["leftover"] = leftover_loras(manager, lora)
        unwrapped = unwrapped_paths(model, manager)
        result["bypassed"] = [f"{m} (unwrapped at {', '.join(p)})" for m, p in unwrapped.items() if m in deltas]
        # wrapped, bypassed too, but given no LoRA by this adapter: a target that would be bypassed if trained
        result["bypassed_untrained"] = sorted(m for m in unwrapped if m not in deltas)
        # LoRA enabled for the merged load too (no adapter): the same MoE kernel, so the same weight layout
        merged = load_vllm_model(engine_config(case["merged"], int(case["rank"])))
        result["uncovered"] = uncovered_params(model, merged, deltas)
        result["modules_checked"] = len(deltas)
        errors = module_errors(model, merged, deltas)
        result["max_err"] = max(errors.values(), default=0.0)
        result["worst"] = max(errors, key=errors.get, default=None)  # the module.parameter of max_err
        result["rolled_err"] = max(module_errors(model, merged, deltas, roll=True).values(), default=0.0)
        result["dropped_err"] = max(module_errors(model, merged, deltas, drop_first=True).values(), default=0.0)
    except Exception as exc:  # a case's failure is its result; the next case still runs
        traceback.print_exc()
        result["error"] = error_line(exc)
    finally:
        model = manager = lora = merged = deltas = None  # noqa: F841 (free before the next case)
        gc.collect()
    result["seconds"] = round(time.monotonic() - start, 1)
    return result


def main(job_path: str) -> int:
    """Run every case of JOB.json in order and write the results to its `out`, also after each case."""
    job = json.loads(Path(job_path).read_text())
    results = []
    for case in job["cases"]:
        results.append(run_case(case))
        print(json.dumps(results[-1]), flush=True)
        Path(job["out"]).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(f"usage: {sys.argv[0]} JOB.json")
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")  # read when vllm is first imported, inside the functions
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    sys.exit(main(sys.argv[1]))
