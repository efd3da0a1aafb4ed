"""Settings read once (issue 45): the kernel settings (moe/kernels/tiles.py: KernelSettings) and the faults the tests
inject (common/injection.py) come from the environment at their first use in a process and never again; an
in-process test replaces them for a block (kernel_settings_overridden, injected), and that is what the sites read."""

import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors import SafetensorError

from moe_qlora.common.injection import KERNEL_FAULT_ENV, faults_requested, injected, injected_faults, kernel_faults_of
from moe_qlora.moe import self_check
from moe_qlora.moe.kernels import tiles
from moe_qlora.train import checkpoint, position


def test_a_kernel_fault_in_the_registry_fires_on_its_path_only():
    with injected(kernel_fault="grouped_mm:raise,triton:wrong"):
        with pytest.raises(self_check.InjectedKernelFault):
            self_check.with_injected_fault("grouped_mm", lambda: torch.ones(2))
        assert torch.equal(self_check.with_injected_fault("triton", lambda: torch.ones(2)), torch.full((2,), 1.5))
        # control: a path the record does not name computes as it would
        assert torch.equal(self_check.with_injected_fault("torch", lambda: torch.ones(2)), torch.ones(2))
    assert injected_faults().kernel_fault("grouped_mm") is None  # the block's record is gone


def test_an_out_of_memory_in_the_registry_fires_at_its_phase_entry():
    where = position.StepPosition()
    where.start(7)
    with injected(oom="7:optimizer#2"):
        with where.within("optimizer"):  # control: the first entry of the step
            pass
        with pytest.raises(torch.OutOfMemoryError, match="injected by MOE_QLORA_INJECT_OOM"):
            with where.within("optimizer"):
                pass
        where.start(8)  # control: the same entry of another step
        for _ in range(2):
            with where.within("optimizer"):
                pass


def test_a_failpoint_in_the_registry_fires_at_its_point_and_step():
    with injected(failpoint="checkpoint-write:enospc@6"):
        checkpoint.failpoint("checkpoint-write", 5)  # control: another step
        checkpoint.failpoint("rename", 6)  # control: another point
        with pytest.raises(SafetensorError, match="No space left on device"):
            checkpoint.failpoint("checkpoint-write", 6)


def test_the_environment_variables_parse_to_the_settings_and_faults():
    env = {"MOE_QLORA_TRITON_BLOCKS": "16,32,16", "MOE_QLORA_AUTOTUNE": "0", "MOE_QLORA_TARGET_ARCH": "80"}
    got = tiles.KernelSettings.from_environment({**env, "TRITON_INTERPRET": "1"})
    assert got == tiles.KernelSettings(block_override=(16, 32, 16), autotune=False, target_arch=80, interpreted=True)
    assert tiles.KernelSettings.from_environment({}) == tiles.KernelSettings()  # unset: autotuned, not interpreted
    assert not tiles.KernelSettings.from_environment({"TRITON_INTERPRET": "0"}).interpreted
    # the first valid fault of a path wins; an unknown fault is ignored
    spec = "grouped_mm:wrong, triton:raise,torch:bogus,grouped_mm:raise"
    assert kernel_faults_of(spec) == {"grouped_mm": "wrong", "triton": "raise"}
    assert faults_requested(oom="4:forward").oom_on_entering(4, "forward", 1)
    assert not faults_requested(oom="4:forward").oom_on_entering(4, "forward", 2)


def test_pinned_config_overrides_the_settings_not_the_environment():
    environ, settings = dict(os.environ), tiles.kernel_settings()
    with tiles.pinned_config(80):
        assert (tiles.kernel_settings().target_arch, tiles.autotune_requested()) == (80, False)
        assert dict(os.environ) == environ
    assert tiles.kernel_settings() == settings


READ_ONCE = """
import json, os
import triton
from moe_qlora.common.injection import KERNEL_FAULT_ENV, faults_requested, injected_faults
from moe_qlora.moe.kernels.tiles import KernelSettings, kernel_settings

def seen(faults, settings):
    return [faults.kernel_fault("grouped_mm"), settings.block_override, settings.autotune, settings.interpreted]

first = seen(injected_faults(), kernel_settings())
agrees = kernel_settings().interpreted == bool(triton.knobs.runtime.interpret)
os.environ.update({KERNEL_FAULT_ENV: "grouped_mm:wrong", "MOE_QLORA_TRITON_BLOCKS": "32,32,32",
                   "MOE_QLORA_AUTOTUNE": "1", "TRITON_INTERPRET": "0"})
later = seen(injected_faults(), kernel_settings())
fresh = seen(faults_requested(os.environ[KERNEL_FAULT_ENV]), KernelSettings.from_environment())
print(json.dumps({"first": first, "later": later, "fresh": fresh, "agrees": agrees}))
"""


def test_the_environment_is_read_once_per_process():
    """A child process started with a fault and kernel settings in its environment sees them, and keeps seeing them
    after os.environ changes (Triton too built its jitted functions at import); the control: the same parsers on
    the changed environment give the new values, so the change would have shown had it been read again."""
    env = {
        **os.environ,
        KERNEL_FAULT_ENV: "grouped_mm:raise",
        "MOE_QLORA_TRITON_BLOCKS": "16,16,16",
        "MOE_QLORA_AUTOTUNE": "0",
        "TRITON_INTERPRET": "1",
    }
    proc = subprocess.run([sys.executable, "-c", READ_ONCE], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["first"] == out["later"] == ["raise", [16, 16, 16], False, True]
    assert out["fresh"] == ["wrong", [32, 32, 32], True, False]
    assert out["agrees"]  # TRITON_INTERPRET=1: Triton and the settings both interpret
