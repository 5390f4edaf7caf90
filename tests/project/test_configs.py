"""CPU tier: the model-family launch templates in `examples/configs/`.

Each template parses (`bash -n`); its commands (`DRY_RUN=1`, proxy and full size) carry only
flags Megatron or we define (megatron-core 0.16.1 has no `megatron.training`: its config fields,
the launchers' own flags and a list checked against 0.19.2's parser stand in; with
`megatron.training` installed the real parser takes them, and the proxy model is built); the
proxy is small; the full size is the family's public shape in a layout the dispatcher accepts
(`options.check_config`), whatever NODES is. The DeepSeek-V3 proxy's MoE layers (its flags as a
TransformerConfig, grouped experts as the proxy runs them, FP8 dispatch, metrics on) train for
several steps on the CPU: expert-bias updates, per-step metrics (step times printed, not
asserted).
"""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import math
import os
import re
import shlex
import socket
import subprocess
import sys
import types

import pytest

from megatron_deepep.tools import sweep
from megatron_deepep.megatron.options import DeepEPOptions, check_config
from tests.project.test_pretrain_example import build_in_child, launcher_flags, needs_training
from tests.helpers import REPO_ROOT, process_failure

ROOT = REPO_ROOT
CONFIGS = os.path.join(ROOT, "examples", "configs")
FAMILIES = ("deepseek_v3", "qwen3_moe", "mixtral", "gpt_oss")

#: megatron.training flags the templates use that are not config fields (each one is a literal
#: `add_argument` in megatron-core 0.19.2's `megatron/training/arguments.py`).
TRAINING_FLAGS = {"--swiglu", "--group-query-attention", "--decoder-first-pipeline-num-layers",
                  "--decoder-last-pipeline-num-layers", "--rotary-base", "--num-experts",
                  "--moe-layer-freq", "--seq-length", "--max-position-embeddings",
                  "--micro-batch-size", "--global-batch-size"}


def _run(name, mode="proxy", **env):
    full_env = dict(os.environ, DRY_RUN="1", MODE=mode, **env)
    for key in ("NODES", "EP", "PP", "GBS", "GPUS_PER_NODE"):
        if key not in env:
            full_env.pop(key, None)
    return subprocess.run(["bash", os.path.join(CONFIGS, f"{name}.sh")], env=full_env,
                          capture_output=True, text=True, timeout=60)


def proxy_flags(name):
    done = _run(name)
    assert done.returncode == 0, done.stderr
    command = shlex.split(done.stdout.splitlines()[-1])
    assert command[:2] == ["bash", os.path.join(ROOT, "examples", "run_gpt_moe.sh")]
    return command[2:]


def full_run(name, **env):
    """`(environment dict, flags in GPT_MOE_ARGS, sbatch command)` of a full-size dry run."""
    done = _run(name, "full", **env)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    variables = dict(item.split("=", 1) for item in lines[0].split())
    assert lines[1].startswith("GPT_MOE_ARGS=")
    return variables, shlex.split(lines[1][len("GPT_MOE_ARGS="):]), shlex.split(lines[2])


def as_dict(flags):
    """Flag -> value (the last one wins, as argparse does); switches map to True."""
    out = {}
    for i, flag in enumerate(flags):
        if flag.startswith("--"):
            nxt = flags[i + 1] if i + 1 < len(flags) else None
            out[flag] = nxt if nxt is not None and not nxt.startswith("--") else True
    return out


def known_flags():
    from megatron.core.transformer.transformer_config import TransformerConfig
    from megatron_deepep.megatron.register import ARGUMENTS

    known = {"--" + f.name.replace("_", "-") for f in dataclasses.fields(TransformerConfig)}
    known |= {flag for flag, _ in ARGUMENTS} | TRAINING_FLAGS
    for launcher in ("run_gpt_moe.sh", "slurm_gpt_moe.sbatch"):
        known |= {f for f in launcher_flags(launcher) if f.startswith("--")}
    return known


@pytest.mark.parametrize("name", FAMILIES + ("common",))
def test_template_parses(name):
    done = subprocess.run(["bash", "-n", os.path.join(CONFIGS, f"{name}.sh")],
                          capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize("name", FAMILIES)
def test_every_flag_is_known(name):
    known = known_flags()
    _, full, _ = full_run(name)
    for flags in (proxy_flags(name), full):
        unknown = sorted(f for f in flags if f.startswith("--") and f not in known)
        assert not unknown, f"{name}: flags Megatron and we do not define: {unknown}"


@pytest.mark.parametrize("name", FAMILIES)
def test_proxy_is_small_with_the_familys_routing(name):
    flags = as_dict(proxy_flags(name))
    shape = sweep.FAMILIES[name]
    assert int(flags["--num-experts"]) == shape.experts
    assert int(flags["--moe-router-topk"]) == shape.topk
    assert int(flags["--num-layers"]) <= 4 and int(flags["--hidden-size"]) <= 1024
    assert int(flags["--num-attention-heads"]) <= 8
    hidden, ffn = int(flags["--hidden-size"]), int(flags["--moe-ffn-hidden-size"])
    assert shape.experts * 3 * hidden * ffn * int(flags["--num-layers"]) < 100e6  # parameters
    assert "--pipeline-model-parallel-size" not in flags  # one machine, EP = its GPUs
    options = DeepEPOptions(fp8_dispatch=flags["--moe-mdeep-fp8-dispatch"])
    check_config(_config(flags), options, ep_size=1)


def _config(flags):
    return types.SimpleNamespace(
        num_moe_experts=int(flags["--num-experts"]), hidden_size=int(flags["--hidden-size"]),
        expert_tensor_parallel_size=1, moe_enable_deepep=False)


@pytest.mark.parametrize("name", FAMILIES)
@pytest.mark.parametrize("nodes", [None, 1, 2, 16, 64])
def test_full_size_layout(name, nodes):
    env = {} if nodes is None else {"NODES": str(nodes)}
    variables, flags_list, sbatch_cmd = full_run(name, **env)
    flags = as_dict(flags_list)
    shape = sweep.FAMILIES[name]
    assert (int(flags["--hidden-size"]), int(flags["--num-experts"]),
            int(flags["--moe-router-topk"]), int(flags["--moe-ffn-hidden-size"])) == (
        shape.hidden, shape.experts, shape.topk, shape.moe_ffn_hidden)
    assert int(flags["--num-layers"]) == shape.moe_layers
    num_nodes = int(sbatch_cmd[sbatch_cmd.index("--nodes") + 1])
    gpus = int(variables["GPUS_PER_NODE"])
    pp, ep = int(flags["--pipeline-model-parallel-size"]), int(variables["EP"])
    assert pp == sweep.FAMILY_PIPELINE_STAGES[name]
    world = num_nodes * gpus
    dp = world // pp
    assert world % pp == 0 and dp % ep == 0 and shape.experts % ep == 0
    if nodes is None:
        assert ep >= 4  # the family's layout
    layers = int(flags["--num-layers"])
    first = int(flags.get("--decoder-first-pipeline-num-layers", 0))
    last = int(flags.get("--decoder-last-pipeline-num-layers", 0))
    middle = pp - bool(first) - bool(last)
    assert middle > 0 and (layers - first - last) % middle == 0
    mbs, gbs = int(flags["--micro-batch-size"]), int(flags["--global-batch-size"])
    assert gbs % (dp * mbs) == 0
    seq = int(flags["--seq-length"])
    assert int(flags["--moe-mdeep-num-max-tokens-per-rank"]) == seq * mbs
    fp8 = flags["--moe-mdeep-fp8-dispatch"]
    options = DeepEPOptions(fp8_dispatch=fp8, num_sms=int(flags["--moe-mdeep-num-sms"]),
                            num_max_tokens_per_rank=seq * mbs)
    check_config(_config(flags), options, ep_size=ep)
    if fp8 == "mxfp8":
        assert shape.hidden % 32 == 0
    if "--moe-router-num-groups" in flags:
        groups, group_topk = int(flags["--moe-router-num-groups"]), int(
            flags["--moe-router-group-topk"])
        assert shape.experts % groups == 0 and group_topk <= groups
        assert shape.topk <= group_topk * shape.experts // groups
    assert sbatch_cmd[0] == "sbatch" and sbatch_cmd[-1].endswith("slurm_gpt_moe.sbatch")


def test_bad_layouts_are_refused_with_a_reason():
    done = _run("deepseek_v3", "full", NODES="1", PP="3")
    assert done.returncode == 2 and "do not split into PP=3" in done.stderr
    done = _run("mixtral", "full", NODES="4", EP="3")
    assert done.returncode == 2 and "EP=3 must divide" in done.stderr
    done = _run("qwen3_moe", "full", NODES="2", GBS="101")
    assert done.returncode == 2 and "GBS=101" in done.stderr
    done = _run("gpt_oss", "nonsense")
    assert done.returncode == 2 and "MODE must be proxy or full" in done.stderr


def test_deepseek_routing_flags():
    flags = as_dict(proxy_flags("deepseek_v3"))
    assert flags["--moe-router-score-function"] == "sigmoid"
    assert flags["--moe-router-enable-expert-bias"] is True
    assert flags["--moe-shared-expert-intermediate-size"]
    assert flags["--moe-mdeep-fp8-dispatch"] == "blockwise"


def test_pretrain_example_appends_gpt_moe_args():
    """`examples/pretrain_gpt_moe.py` appends `GPT_MOE_ARGS` (read without importing it: it
    imports `megatron.training`)."""
    path = os.path.join(ROOT, "examples", "pretrain_gpt_moe.py")
    tree = ast.parse(open(path, encoding="utf-8").read())
    func = next(n for n in tree.body if isinstance(n, ast.FunctionDef)
                and n.name == "append_env_args")
    namespace = {"shlex": shlex, "os": os}
    exec(compile(ast.Module(body=[func], type_ignores=[]), path, "exec"), namespace)
    argv = namespace["append_env_args"](["x.py", "--num-experts", "8"],
                                        {"GPT_MOE_ARGS": "--num-experts 256 --moe-layer-freq "
                                                         "'([0]*3+[1]*58)'"})
    assert argv == ["x.py", "--num-experts", "8", "--num-experts", "256", "--moe-layer-freq",
                    "([0]*3+[1]*58)"]
    main = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "main")
    assert "append_env_args" in ast.unparse(main.body[0])


@needs_training
@pytest.mark.parametrize("name", FAMILIES)
def test_proxy_parses_and_builds_with_megatron_training(name, tmp_path):
    flags = launcher_flags("run_gpt_moe.sh", out=str(tmp_path)) + proxy_flags(name)
    flags += ["--use-cpu-initialization"]
    flags.remove("--bf16")
    import torch

    if not torch.cuda.is_available():  # Megatron allocates the expert bias on the GPU
        flags = [f for f in flags if f != "--moe-router-enable-expert-bias"]
    report = build_in_child(flags, 29627)
    assert report["dispatchers"] == ["DeepEPTokenDispatcher"] * 4


_PARSE_CHILD = r"""
import json, sys, warnings
warnings.filterwarnings("ignore")
import megatron_deepep.megatron as mdm
mdm.register_deepep_dispatcher()
from megatron.training.arguments import parse_args
sys.argv = ["pretrain_gpt_moe.py"] + json.loads(sys.argv[1])
args = parse_args(mdm.add_arguments)
print("PARSED", args.num_experts, args.pipeline_model_parallel_size)
"""


@needs_training
@pytest.mark.parametrize("name", FAMILIES)
def test_full_size_flags_parse_with_megatron_training(name):
    _, flags, _ = full_run(name)
    import json

    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    all_flags = launcher_flags("slurm_gpt_moe.sbatch") + flags
    done = subprocess.run([sys.executable, "-c", _PARSE_CHILD, json.dumps(all_flags)], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    shape = sweep.FAMILIES[name]
    assert re.search(rf"PARSED {shape.experts} {sweep.FAMILY_PIPELINE_STAGES[name]}",
                     done.stdout)


_TRAIN_CHILD = r"""
import dataclasses, functools, json, sys, time, warnings
warnings.filterwarnings("ignore")
import torch
from megatron_deepep.bench import layer_variants as lv

flags, steps, metrics_dir = json.loads(sys.argv[1]), int(sys.argv[2]), sys.argv[3]


def parse(value):
    if value is True:
        return True
    for kind in (int, float):
        try:
            return kind(value)
        except ValueError:
            pass
    return value


from megatron.core.transformer.transformer_config import TransformerConfig
fields = {f.name for f in dataclasses.fields(TransformerConfig)}
kwargs = dict(add_bias_linear=False, gradient_accumulation_fusion=False, bf16=True,
              params_dtype=torch.bfloat16, use_cpu_initialization=True,
              moe_token_dispatcher_type="deepep")
ours = {}
for flag, value in flags.items():
    name = flag[2:].replace("-", "_")
    if name == "num_experts":
        kwargs["num_moe_experts"] = int(value)
    elif name == "swiglu":
        kwargs.update(gated_linear_unit=True, activation_func=torch.nn.functional.silu)
    elif name.startswith("moe_mdeep_"):
        ours[name] = parse(value)
    elif name in fields:
        kwargs[name] = parse(value)
report = {"unused": sorted(f for f in flags if f[2:].replace("-", "_") not in fields
                           and f not in ("--num-experts", "--swiglu")
                           and not f.startswith("--moe-mdeep-"))}
with lv.cpu_stand_ins():
    lv.init_megatron("cpu")
    from megatron.core.distributed.finalize_model_grads import _update_router_expert_bias
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.spec_utils import build_module
    from megatron_deepep.megatron import metrics

    config = TransformerConfig(**kwargs)
    for name, value in dict(ours, moe_mdeep_transport="reference", moe_mdeep_metrics=True,
                            moe_mdeep_metrics_dir=metrics_dir).items():
        setattr(config, name, value)  # as a patched Megatron's config fields
    spec = get_gpt_layer_local_spec(config.num_moe_experts, False)
    grouped_spec, report["note"] = lv.with_grouped_mm_experts(spec, "cpu")

    def moe_layers(layer_spec, seed):
        torch.manual_seed(seed)
        moe = layer_spec.submodules.mlp
        return torch.nn.ModuleList(
            moe(config=config, layer_number=i + 1) if isinstance(moe, functools.partial)
            else build_module(moe, config=config, layer_number=i + 1)
            for i in range(config.num_layers))

    # The swap computes what Megatron's SequentialMLP does, given the same weights.
    sequential, layers = moe_layers(spec, 1), moe_layers(grouped_spec, 2)
    with torch.no_grad():
        for seq, grp in zip(sequential, layers):
            for name in ("router", "shared_experts"):
                getattr(grp, name).load_state_dict(getattr(seq, name).state_dict())
            for e, mlp in enumerate(seq.experts.local_experts):
                grp.experts.weight1[e].copy_(mlp.linear_fc1.weight.t())
                grp.experts.weight2[e].copy_(mlp.linear_fc2.weight.t())
        x = torch.randn(64, 2, config.hidden_size).bfloat16()
        want, got = sequential[0](x)[0].float(), layers[0](x)[0].float()
    report["max_rel_diff"] = ((got - want).abs().max() / want.abs().max()).item()
    metrics.flush(-1)
    report["experts"] = type(layers[0].experts).__name__
    report["dispatcher"] = type(layers[0].token_dispatcher).__name__
    optimizer = torch.optim.Adam(layers.parameters(), lr=1e-3)
    report.update(step_s=[], loss=[], flushed=[])
    bias0 = layers[0].router.expert_bias.clone()
    gen = torch.Generator().manual_seed(0)
    for step in range(steps):
        t0 = time.perf_counter()
        h = torch.randn(128, 2, config.hidden_size, generator=gen).bfloat16()
        for layer in layers:
            h = h + layer(h)[0]
        loss = h.float().square().mean()
        loss.backward()
        _update_router_expert_bias([layers], config)  # Megatron's finalize_model_grads
        for layer in layers:
            layer.router.local_tokens_per_expert.zero_()
        optimizer.step()
        optimizer.zero_grad()
        report["flushed"].append(len(metrics.flush(step)))
        report["step_s"].append(time.perf_counter() - t0)
        report["loss"].append(loss.item())
    report["bias_moved"] = (layers[0].router.expert_bias - bias0).abs().max().item()
print("REPORT " + json.dumps(report))
"""


def test_deepseek_proxy_moe_layers_train_on_cpu(tmp_path):
    """The DeepSeek-V3 proxy's MoE path (256 experts, top-8, sigmoid + expert bias,
    group-limited routing, seq aux loss, shared expert, FP8 blockwise dispatch, metrics on) with
    the grouped experts the proxy trains with: equal to SequentialMLP's output, then 6 training
    steps (their times printed: the GPU proxy once stalled after its third step)."""
    import json

    flags = as_dict(proxy_flags("deepseek_v3"))
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    steps = 6
    done = subprocess.run([sys.executable, "-c", _TRAIN_CHILD, json.dumps(flags), str(steps),
                           str(tmp_path / "metrics")], env=env, capture_output=True, text=True,
                          timeout=600)
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("REPORT ")]
    assert done.returncode == 0 and lines, process_failure(done)
    report = json.loads(lines[-1][len("REPORT "):])
    assert report["unused"] == [], report["unused"]  # every proxy flag reached the config
    assert report["experts"] == "GroupedMMExperts", report["note"]
    assert report["dispatcher"] == "DeepEPTokenDispatcher"
    assert report["max_rel_diff"] < 3e-2
    assert all(math.isfinite(v) for v in report["loss"])
    assert report["flushed"] == [4] * steps  # every MoE layer's metrics, every step
    assert report["bias_moved"] > 0  # the aux-loss-free balancing bias is updated
    lines = (tmp_path / "metrics" / "deepep_metrics_rank0.jsonl").read_text().splitlines()
    assert [json.loads(ln)["step"] for ln in lines] == [-1] + list(range(steps))
    # Step times are printed, not asserted: the CPU tier runs on shared, loaded machines (a
    # stalled step on the GPU is the GPU tier's and the benchmarks' to catch).
    print("\nstep times (s): " + ", ".join(f"{t:.2f}" for t in report["step_s"]))


# ----------------------------------------------------------------------------------------------
# Without a GPU: the template trains its own flags on the CPU, never the generic demo.

def _megatron_flags():
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "megatron_flags", os.path.join(ROOT, "examples", "megatron_flags.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules["megatron_flags"] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("name", FAMILIES)
def test_cpu_proxy_places_every_flag_of_the_family(name):
    """Every proxy flag reaches the CPU run's model (the family's experts, top-k and routing)
    or is dropped with its reason; none is ignored silently."""
    mf = _megatron_flags()
    flags = proxy_flags(name)
    placed = mf.parse(flags)
    shape = sweep.FAMILIES[name]
    assert (placed.args["num_experts"], placed.args["topk"]) == (shape.experts, shape.topk)
    given = as_dict(flags)
    assert placed.deepep["fp8_dispatch"] == given["--moe-mdeep-fp8-dispatch"]
    dropped = dict(placed.dropped)
    assert set(dropped) == {"--moe-mdeep-num-sms"}, dropped  # the kernels' SM budget only
    for flag, text in given.items():
        field = flag[2:].replace("-", "_")
        assert (flag in mf.ARGS or flag in mf.MODEL or flag in dropped or flag in mf.IMPLIED
                or flag == "--swiglu" or field in placed.config
                or field[len("moe_mdeep_"):] in placed.deepep), flag
    if "--moe-router-num-groups" in given:  # DeepSeek-V3's group-limited routing
        assert placed.config["moe_router_num_groups"] == int(given["--moe-router-num-groups"])
        assert placed.config["moe_router_group_topk"] == int(given["--moe-router-group-topk"])
    with pytest.raises(mf.FlagError, match=r"^--no-such-flag is no TransformerConfig field"):
        mf.parse(flags + ["--no-such-flag", "3"])
    on_gpus = mf.parse(flags, cpu=False)  # the same flags on GPUs: the SM budget is kept
    assert on_gpus.deepep["num_sms"] == 24 and not on_gpus.dropped


def test_template_without_a_gpu_passes_its_flags_to_the_cpu_run(tmp_path):
    """`bash examples/configs/<family>.sh` on a machine without a GPU: run_gpt_moe.sh's CPU path
    gets the family's flags after `--`, its name, the metrics folder and CPU_TRAIN_ITERS (a
    stand-in python records the command; prepare_env says "cpu-demo")."""
    record = tmp_path / "argv.txt"
    fake = tmp_path / "python"
    fake.write_text(f"""#!/usr/bin/env bash
case "$1" in
  *prepare_env.py) echo "cpu-demo 0" ;;
  *megatron_flags.py) exec {sys.executable} "$@" ;;
  -m) printf '%s\\n' "$@" > {record} ;;
esac
""")
    fake.chmod(0o755)
    env = dict(os.environ, PYTHON=str(fake), OUT=str(tmp_path / "run"))
    for key in ("DRY_RUN", "MODE", "METRICS", "CPU_TRAIN_ITERS", "TRAIN_ITERS"):
        env.pop(key, None)
    done = subprocess.run(["bash", os.path.join(CONFIGS, "deepseek_v3.sh")], env=env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    argv = record.read_text().splitlines()
    assert argv[argv.index("--steps") + 1] == "10"
    assert argv[argv.index("--metrics-dir") + 1] == str(tmp_path / "run" / "metrics")
    assert argv[argv.index("--name") + 1] == "deepseek_v3"
    assert argv[argv.index("--") + 1:] == proxy_flags("deepseek_v3")
    assert "the model of the flags above, on the CPU" in done.stderr
    assert "--plot-only" in done.stderr


def port_with_neighbours_held(count: int):
    """A free port P, with listening sockets held on P+1 .. P+count (the caller closes them)."""
    for _ in range(50):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        held = []
        try:
            for neighbour in range(port + 1, port + 1 + count):
                sock = socket.socket()
                held.append(sock)
                sock.bind(("127.0.0.1", neighbour))
                sock.listen()
            return port, held
        except OSError:
            for sock in held:
                sock.close()
    raise RuntimeError(f"no free port with {count} free ports above it")


def test_deepseek_cpu_proxy_trains_its_routing_and_writes_the_report(tmp_path):
    """The DeepSeek-V3 proxy's flags through compare_dispatchers.py --cpu (what the template
    runs without a GPU): says what it trains and drops, writes every metrics field, and the
    report renders them."""
    import json

    flags = proxy_flags("deepseek_v3")
    env = dict(os.environ, OMP_NUM_THREADS="1", MDEEP_GROUPED_MM_EXPERTS="1",
               MDEEP_COMM_SHARE_WARN="0",
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    metrics_dir = tmp_path / "metrics"
    # The ports just above MASTER_PORT are taken: the children meet on free ones regardless.
    master_port, held = port_with_neighbours_held(3)
    with contextlib.ExitStack() as stack:
        for sock in held:
            stack.enter_context(sock)
        done = subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node",
             "2", "--master-addr", "127.0.0.1", "--master-port", str(master_port),
             os.path.join(ROOT, "examples", "compare_dispatchers.py"), "--cpu", "--steps", "3",
             "--out", str(tmp_path), "--metrics-dir", str(metrics_dir), "--name",
             "deepseek_v3", "--", *flags], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, process_failure(done)
    out = done.stdout
    assert ("deepseek_v3: 4 MoE layers, hidden 256, 256 experts, top-8, sigmoid scores, expert "
            "bias, a token's experts in 4 of 8 groups, seq_aux_loss, a shared expert") in out
    assert "FP8 dispatch blockwise: quantized and dequantized in torch" in out
    assert "dropped (no meaning in this run): --moe-mdeep-num-sms" in out
    lines = [json.loads(ln) for ln in
             (metrics_dir / "deepep_metrics_rank0.jsonl").read_text().splitlines()]
    assert [ln["step"] for ln in lines] == [0, 1, 2] and len(lines[0]["layers"]) == 4
    layer = lines[-1]["layers"]["1"]
    for key in ("comm_share", "idle_share_time", "tokens_dropped", "expert_ms_per_rank"):
        assert key in layer, key
    assert len(layer["tokens_per_expert"]) == 256 and len(layer["tokens_per_rank"]) == 2
    report = subprocess.run([sys.executable, "-m", "megatron_deepep.tools.report",
                             str(metrics_dir), "--no-png"], capture_output=True, text=True,
                            timeout=120, env=env)
    assert report.returncode == 0, report.stderr
    text = (metrics_dir / "report.html").read_text(encoding="utf-8")
    assert "4 MoE layer(s), EP = 2, 256 experts" in text and "comm share not recorded" not in text
