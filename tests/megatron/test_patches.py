"""The patches in patches/ apply to the matching megatron-core files, and make `deepep` work.

The tree under test is a copy of the installed megatron-core laid out as Megatron-LM
(`megatron/core/...`); the 0.19 patch is also checked against a megatron-core 0.19.x wheel's
files on every leg (`.whl/`'s, else downloaded from PyPI by the test).
"""

from __future__ import annotations

import glob
import os
import re
import shutil
import subprocess
import sys
import textwrap
import zipfile

import pytest
from tests.helpers import REPO_ROOT

ROOT = REPO_ROOT
PATCHES = os.path.join(ROOT, "patches")
GENERATE = os.path.join(PATCHES, "generate.py")


def _installed_megatron():
    import megatron.core

    return os.path.dirname(os.path.dirname(megatron.core.__file__)), megatron.core.__version__


def _tree(tmp_path, name="tree"):
    src, _ = _installed_megatron()
    root = tmp_path / name
    shutil.copytree(src, root / "megatron",
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "*.so"))
    subprocess.run(["git", "init", "-q"], cwd=root, check=True)
    return root


def _git_apply(root, patch, check_only=False):
    args = ["git", "apply"] + (["--check"] if check_only else []) + [patch]
    return subprocess.run(args, cwd=root, capture_output=True, text=True)


def _patch_for(version):
    major_minor = tuple(int(v) for v in version.split(".")[:2])
    if major_minor == (0, 16):
        return os.path.join(PATCHES, "megatron-core-0.16.patch")
    if major_minor >= (0, 17):
        return os.path.join(PATCHES, "megatron-core-0.17-0.19-main.patch")
    return None


_ACCEPT_SCRIPT = textwrap.dedent("""
    import os, warnings
    warnings.filterwarnings("ignore")
    import torch, torch.distributed as dist
    import megatron.core
    assert megatron.core.__file__.startswith(os.environ["PATCHED_TREE"]), megatron.core.__file__
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ["TEST_PORT"])
    dist.init_process_group("gloo", rank=0, world_size=1)
    from megatron.core import parallel_state as ps
    ps.initialize_model_parallel()
    import megatron_deepep.megatron.register as reg
    from megatron.core.transformer.transformer_config import TransformerConfig
    from megatron.core.transformer.moe.moe_layer import MoELayer, MoESubmodules
    from megatron.core.transformer.moe.experts import SequentialMLP
    from megatron.core.transformer.mlp import MLPSubmodules
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron_deepep.megatron import DeepEPTokenDispatcher
    cfg = TransformerConfig(num_layers=2, hidden_size=32, ffn_hidden_size=64,
                            num_attention_heads=4, num_moe_experts=4, moe_router_topk=2,
                            moe_token_dispatcher_type="deepep", use_cpu_initialization=True,
                            add_bias_linear=False, gradient_accumulation_fusion=False,
                            moe_shared_expert_intermediate_size=64,
                            moe_shared_expert_overlap=True, moe_mdeep_num_sms=5,
                            moe_mdeep_fp8_dispatch="mxfp8")
    TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4, num_moe_experts=4,
                      moe_token_dispatcher_type="deepep", overlap_moe_expert_parallel_comm=True,
                      expert_model_parallel_size=2, bf16=True)
    cfg.moe_shared_expert_intermediate_size = None
    cfg.moe_shared_expert_overlap = False
    sub = MoESubmodules(experts=ModuleSpec(module=SequentialMLP, submodules=MLPSubmodules(
        linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear)))
    layer = MoELayer(cfg, sub, layer_number=2)
    assert isinstance(layer.token_dispatcher, DeepEPTokenDispatcher)
    assert layer.token_dispatcher.layer_number == 2
    assert layer.token_dispatcher.options.num_sms == 5
    assert layer.token_dispatcher.options.fp8_dispatch == "mxfp8"
    assert not reg.is_registered(), "the patched tree must not need the runtime plugin"
    try:
        from megatron.core.models.common.utils import should_free_input
        assert should_free_input("mlp", True, cfg, 4) is False
    except ImportError:
        from megatron.core.models.gpt.fine_grained_callables import should_free_input
        assert should_free_input("mlp", True, cfg) is False
    print("DEEPEP_ACCEPTED")
""")


def _free_port():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


def test_patch_applies_to_installed_megatron_and_deepep_is_accepted(tmp_path):
    _, version = _installed_megatron()
    patch = _patch_for(version)
    if patch is None:
        pytest.skip(f"no shipped patch for megatron-core {version}")
    root = _tree(tmp_path)
    check = _git_apply(root, patch, check_only=True)
    assert check.returncode == 0, check.stderr
    assert _git_apply(root, patch).returncode == 0
    # Applying twice is refused (git apply is not idempotent), the generator is.
    assert _git_apply(root, patch, check_only=True).returncode != 0

    env = dict(os.environ, PYTHONPATH=f"{root}{os.pathsep}{ROOT}", PATCHED_TREE=str(root),
               TEST_PORT=_free_port())
    proc = subprocess.run([sys.executable, "-c", _ACCEPT_SCRIPT], env=env, capture_output=True,
                          text=True, timeout=150)
    assert proc.returncode == 0 and "DEEPEP_ACCEPTED" in proc.stdout, proc.stderr[-4000:]


def test_unpatched_tree_refuses_deepep(tmp_path):
    root = _tree(tmp_path)
    env = dict(os.environ, PYTHONPATH=f"{root}{os.pathsep}{ROOT}", PATCHED_TREE=str(root),
               TEST_PORT=_free_port())
    proc = subprocess.run([sys.executable, "-c", _ACCEPT_SCRIPT], env=env, capture_output=True,
                          text=True, timeout=150)
    assert proc.returncode != 0 and "DEEPEP_ACCEPTED" not in proc.stdout


def _strip_index(patch_text):
    return "\n".join(l for l in patch_text.splitlines() if not l.startswith("index "))


def test_generator_reproduces_the_shipped_patch(tmp_path):
    _, version = _installed_megatron()
    patch = _patch_for(version)
    if patch is None:
        pytest.skip(f"no shipped patch for megatron-core {version}")
    root = _tree(tmp_path)
    out = subprocess.run([sys.executable, GENERATE, str(root), "--diff"], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    with open(patch, encoding="utf-8") as f:
        assert _strip_index(out.stdout) == _strip_index(f.read())
    # In-place edit, twice: the second run changes nothing.
    cfg = root / "megatron/core/transformer/transformer_config.py"
    snapshots = []
    for _ in range(2):
        assert subprocess.run([sys.executable, GENERATE, str(root)], capture_output=True,
                              timeout=120).returncode == 0
        snapshots.append(cfg.read_text())
    assert snapshots[0] == snapshots[1]
    text = snapshots[0]
    assert text.count("moe_mdeep_transport:") == 1 and text.count("'deepep'") >= 2
    # A tree patched before a field existed gets just the missing field, after the others.
    sys.path.insert(0, PATCHES)
    try:
        import generate
    finally:
        sys.path.remove(PATCHES)
    names = [generate._field_name(b) for b in generate.FIELD_BLOCKS]
    assert "moe_mdeep_fp8_dispatch" in names
    cfg.write_text(text.replace("\n\n" + generate.FIELD_BLOCKS[-1], "", 1))
    assert f"{names[-1]}:" not in cfg.read_text()
    assert subprocess.run([sys.executable, GENERATE, str(root)], capture_output=True,
                          timeout=120).returncode == 0
    assert cfg.read_text() == text


# megatron-core 0.19.x from PyPI for the 0.19 patch check on any leg (the wheel is for Python
# 3.12; only its .py files are read). CI reaches PyPI; offline, put the wheel in `.whl/`.
MEGATRON_019 = "megatron-core>=0.19,<0.20"


def _megatron_019_wheel(cache_dir) -> str:
    """A megatron-core 0.19.x wheel: `.whl/`'s, else one `pip download` (2.4 MB) into
    `cache_dir`.

    Raises:
        pytest.fail: the download failed (pip's output, and the offline alternative).
    """
    pattern = "megatron_core-0.19*.whl"
    found = sorted(glob.glob(os.path.join(ROOT, ".whl", pattern))
                   + glob.glob(os.path.join(str(cache_dir), pattern)))
    if found:
        return found[-1]
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
         "--python-version", "3.12", "--platform", "manylinux_2_28_x86_64", "--platform",
         "manylinux2014_x86_64", "--platform", "any", MEGATRON_019, "-d", str(cache_dir)],
        capture_output=True, text=True, timeout=300)
    found = sorted(glob.glob(os.path.join(str(cache_dir), pattern)))
    if proc.returncode != 0 or not found:
        pytest.fail(f"pip download {MEGATRON_019} failed (exit {proc.returncode}): "
                    f"{proc.stderr[-2000:]}\nOffline, put a megatron_core-0.19 wheel in .whl/")
    return found[-1]


def test_019_patch_applies_to_the_wheel(tmp_path):
    wheel = _megatron_019_wheel(tmp_path / "wheel")
    root = tmp_path / "w19"
    with zipfile.ZipFile(wheel) as z:
        for name in z.namelist():
            if name.startswith("megatron/") and name.endswith(".py"):
                z.extract(name, root)
    subprocess.run(["git", "init", "-q"], cwd=root, check=True)
    patch = os.path.join(PATCHES, "megatron-core-0.17-0.19-main.patch")
    check = _git_apply(root, patch, check_only=True)
    assert check.returncode == 0, check.stderr
    assert _git_apply(root, patch).returncode == 0
    text = (root / "megatron/core/transformer/moe/moe_utils.py").read_text()
    assert 'moe_token_dispatcher_type == "deepep"' in text


_LEGACY_ARGS = textwrap.dedent("""\
    def _add_moe_args(parser):
        group = parser.add_argument_group(title="moe")
        group.add_argument('--moe-token-dispatcher-type', type=str,
                           choices=['allgather', 'alltoall', 'flex'],
                           default='allgather',
                           help="The type of token dispatcher to use.")
        return parser
""")


def test_generator_legacy_family(tmp_path):
    """0.13-0.15 layout: hand-written CLI choices, `str` config field, `model_comm_pgs`."""
    root = _tree(tmp_path, "legacy")
    cfg = root / "megatron/core/transformer/transformer_config.py"
    text = cfg.read_text()
    # The field itself, not 0.19's `inference_moe_token_dispatcher_type: Literal[...]`.
    legacy_cfg = re.sub(r"^([ \t]*)moe_token_dispatcher_type: Literal\[[^\]]*\]",
                        r"\1moe_token_dispatcher_type: str", text, count=1, flags=re.M)
    assert legacy_cfg != text
    cfg.write_text(legacy_cfg)
    layer = root / "megatron/core/transformer/moe/moe_layer.py"
    layer.write_text(layer.read_text().replace("pg_collection=pg_collection",
                                               "model_comm_pgs=model_comm_pgs"))
    # The fixture's megatron/training is only the legacy arguments.py: the 0.17+ wheels ship a
    # megatron/training of their own (0.19's derives the choices from the config Literal).
    training = root / "megatron/training"
    shutil.rmtree(training, ignore_errors=True)
    training.mkdir(parents=True)
    args = training / "arguments.py"
    args.write_text(_LEGACY_ARGS)
    out = subprocess.run([sys.executable, GENERATE, str(root)], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0 and "(legacy family)" in out.stdout, (out.stdout, out.stderr)
    assert "choices=['allgather', 'alltoall', 'flex', 'deepep']" in args.read_text()
    new_layer = layer.read_text()
    assert 'moe_token_dispatcher_type == "deepep"' in new_layer
    branch = new_layer.split('== "deepep"')[1].split("else:")[0]
    assert "model_comm_pgs=model_comm_pgs" in branch
    # The legacy family leaves the config (and so the A2A-overlap allowlist) alone.
    assert cfg.read_text() == legacy_cfg


def test_generator_names_a_missing_anchor(tmp_path):
    root = tmp_path / "empty"
    (root / "megatron/core/transformer/moe").mkdir(parents=True)
    (root / "megatron/core/transformer/transformer_config.py").write_text(
        "moe_token_dispatcher_type: Literal['allgather'] = 'allgather'\n")
    (root / "megatron/core/transformer/moe/moe_layer.py").write_text("pass\n")
    out = subprocess.run([sys.executable, GENERATE, str(root)], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 2 and "anchor" in out.stderr
