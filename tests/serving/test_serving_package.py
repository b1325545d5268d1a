"""The ``serving`` package root: its public names, an import without side effects, ``enable_command_buffers``."""

import os
import subprocess
import sys

import pytest
from helpers import REPO

import serving
from serving.engine.sampling_params import SamplingParams
from serving.llm_engine import Engine
from serving.loaders.model import LoadedModel, load_model
from serving.spec_decode.config import SpecConfig
from serving.structured import ConstraintSpec


def test_public_names_are_the_defining_modules_objects():
    from serving import ConstraintSpec as root_constraint
    from serving import Engine as root_engine

    assert (root_engine, serving.SamplingParams, serving.LoadedModel, serving.SpecConfig, root_constraint,
            serving.load_model) == (Engine, SamplingParams, LoadedModel, SpecConfig, ConstraintSpec, load_model)
    assert set(serving.__all__) >= {"Engine", "SamplingParams", "LoadedModel", "SpecConfig", "ConstraintSpec",
                                    "load_model", "enable_command_buffers"}
    with pytest.raises(AttributeError, match="no attribute 'Engin'"):
        serving.Engin  # noqa: B018


def test_import_leaves_the_environment_alone_and_loads_no_jax():
    script = ("import os, sys; before = dict(os.environ); import serving; "
              "print(dict(os.environ) == before, 'jax' in sys.modules)")
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    out = subprocess.run([sys.executable, "-c", script], cwd=REPO, env=env, capture_output=True, text=True,
                         check=True).stdout.split()
    assert out == ["True", "False"]


def test_enable_command_buffers_adds_the_flags_unless_xla_flags_sets_them(monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    serving.enable_command_buffers()
    assert os.environ["XLA_FLAGS"] == f"--xla_force_host_platform_device_count=8 {serving.COMMAND_BUFFER_FLAGS}"
    serving.enable_command_buffers()  # already set: unchanged
    assert os.environ["XLA_FLAGS"].count("xla_gpu_enable_command_buffer") == 1
    monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_enable_command_buffer=")  # the caller's choice: kept
    serving.enable_command_buffers()
    assert os.environ["XLA_FLAGS"] == "--xla_gpu_enable_command_buffer="
    monkeypatch.delenv("XLA_FLAGS")
    serving.enable_command_buffers()
    assert os.environ["XLA_FLAGS"] == serving.COMMAND_BUFFER_FLAGS
