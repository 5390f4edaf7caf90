#!/usr/bin/env python3
"""Adds the `deepep` dispatcher type to a Megatron-LM source tree, or prints it as a git patch.

    python patches/generate.py /path/to/Megatron-LM            # edit the tree in place
    python patches/generate.py /path/to/Megatron-LM --diff     # print a git patch instead

The edits are anchored on code, not line numbers, so they work on trees the shipped patches do
not match (forks). Families (`--family`, default: detected):

* `core` (0.16 and later, main): the config Literal, our `moe_mdeep_*` fields, the shared-expert
  and A2A-overlap allowlists, the MoELayer branch, `should_free_input`, and
  `skip_routed_expert_padding` where it exists;
* `legacy` (0.13 to 0.15): the `--moe-token-dispatcher-type` choices in
  `megatron/training/arguments.py` and the MoELayer branch (`model_comm_pgs` on 0.13/0.14,
  `pg_collection` on 0.15). The A2A overlap stays refused for deepep there: those versions'
  `should_free_input(name, is_moe, is_deepep)` cannot express our memory policy.

An edit whose anchor is missing fails with the file and the anchor it looked for; an edit that
is already present is skipped, so running it twice is harmless.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import shutil

TYPE = "deepep"

FIELDS = '''
    moe_mdeep_transport: Optional[str] = None
    """megatron_deepep (--moe-token-dispatcher-type deepep): "auto", "local", "nvlink" or
    "reference". None: MDEEP_TRANSPORT or "auto"."""

    moe_mdeep_num_sms: Optional[int] = None
    """megatron_deepep: SM budget of the communication kernels. None: MDEEP_NUM_SMS or 24."""

    moe_mdeep_num_max_tokens_per_rank: Optional[int] = None
    """megatron_deepep: the most tokens one rank dispatches per call (sizes the buffer; the same
    on every rank). None: the next power of two of the first call's tokens, at least 4096."""

    moe_mdeep_metrics: bool = False
    """megatron_deepep: per-layer communication and load metrics in the MoE metrics tracker
    (False: MDEEP_METRICS decides)."""

    moe_mdeep_metrics_dir: Optional[str] = None
    """megatron_deepep: also write the metrics as JSON lines here (scripts/plot_metrics.py)."""

    moe_mdeep_fp8_dispatch: Optional[str] = None
    """megatron_deepep: FP8 token dispatch: "off", "blockwise" (TE Float8BlockScaling, 1x128
    blocks), "mxfp8" (TE MXFP8BlockScaling, 1x32) or "auto" (the active TE recipe's format;
    bf16 without one). Needs hidden_size % 16 == 0. None: MDEEP_FP8_DISPATCH or "off"."""
'''

#: FIELDS, one `moe_mdeep_*` field (with its docstring) per entry, in order.
FIELD_BLOCKS = FIELDS.strip("\n").split("\n\n")


def _field_name(block):
    return block.split(":", 1)[0].strip()


class EditError(RuntimeError):
    pass


def _read(root, rel):
    path = os.path.join(root, rel)
    if not os.path.exists(path):
        raise EditError(f"{rel}: file not found under {root}")
    with open(path, encoding="utf-8") as f:
        return f.read()


def _write(root, rel, text):
    with open(os.path.join(root, rel), "w", encoding="utf-8") as f:
        f.write(text)


def _sub_once(text, pattern, repl, rel, what, flags=0):
    new, n = re.subn(pattern, repl, text, count=1, flags=flags)
    if n == 0:
        raise EditError(f"{rel}: anchor for {what} not found (pattern {pattern!r})")
    return new


def _add_to_list(match):
    body = match.group("list")
    if f"'{TYPE}'" in body or f'"{TYPE}"' in body:
        return match.group(0)
    quote = '"' if '"' in body else "'"
    stripped = body.rstrip()
    trailing = body[len(stripped):]
    sep = "" if stripped.endswith(",") else ","
    if "\n" in body:
        indent = re.search(r"\n(\s*)\S", body).group(1)
        new_body = f"{stripped}{sep}\n{indent}{quote}{TYPE}{quote},{trailing}"
    else:
        new_body = f"{stripped}{sep} {quote}{TYPE}{quote}{trailing}"
    return match.group(0).replace(body, new_body, 1)


# ----------------------------------------------------------------------------------------------
# The dispatcher field at the start of its line: not `inference_moe_token_dispatcher_type`
# (0.19+, also a Literal) nor a mention in a docstring.
DISPATCHER_FIELD = r"^[ \t]*moe_token_dispatcher_type: "  # with re.M


def edit_config(root):
    rel = "megatron/core/transformer/transformer_config.py"
    text = _read(root, rel)
    field = re.search(DISPATCHER_FIELD + r".*$", text, flags=re.M)
    if field is None or f"'{TYPE}'" not in field.group(0):
        text = _sub_once(text, rf"({DISPATCHER_FIELD}Literal\[)([^\]]*)(\])",
                         lambda m: f"{m.group(1)}{m.group(2)}, '{TYPE}'{m.group(3)}", rel,
                         "the dispatcher Literal", flags=re.M)
    old_doc = "Options are 'allgather','alltoall' and 'flex'."
    if old_doc in text:  # the docstring is cosmetic: edited where it reads as expected
        text = text.replace(old_doc, "Options are 'allgather', 'alltoall', 'flex' and 'deepep' "
                            "(megatron_deepep).", 1)
    # Only the fields the tree lacks: a tree patched by an older release gets the new ones.
    missing = [b for b in FIELD_BLOCKS if f"{_field_name(b)}:" not in text]
    if missing:
        fields = "\n" + "\n\n".join(missing) + "\n"
        text = _sub_once(text, r"\n(    moe_enable_deepep: bool = False\n)",
                         lambda m: fields + "\n" + m.group(1), rel, "the moe_enable_deepep field")
    text = _sub_once(
        text,
        r"if self\.moe_shared_expert_overlap and self\.moe_token_dispatcher_type not in "
        r"\[(?P<list>[^\]]*)\]",
        _add_to_list, rel, "the shared-expert-overlap allowlist")
    text = _sub_once(
        text,
        r"assert self\.moe_token_dispatcher_type in \[(?P<list>[^\]]*)\],\s*\(?\s*"
        r"['\"]overlap_moe_expert_parallel_comm",
        _add_to_list, rel, "the A2A-overlap allowlist")
    _write(root, rel, text)


def edit_moe_layer(root, group_kw):
    rel = "megatron/core/transformer/moe/moe_layer.py"
    text = _read(root, rel)
    if f'== "{TYPE}"' in text:
        return
    branch = (
        f'        elif config.moe_token_dispatcher_type == "{TYPE}":\n'
        f"            # megatron_deepep (pip install 'megatron_deepep[jit]'): our EP kernels.\n"
        f"            from megatron_deepep.megatron.dispatcher import DeepEPTokenDispatcher\n\n"
        f"            self.token_dispatcher = DeepEPTokenDispatcher(\n"
        f"                self.num_local_experts,\n"
        f"                self.local_expert_indices,\n"
        f"                config=self.config,\n"
        f"                {group_kw}={group_kw},\n"
        f"            )\n"
        f"            self.token_dispatcher.bind_layer(self)\n")
    text = _sub_once(
        text,
        r"(\n)(        else:\n            raise ValueError\(\n"
        r"\s*f\"Unsupported token dispatcher type)",
        lambda m: m.group(1) + branch + m.group(2), rel, "the dispatcher if/elif chain")
    _write(root, rel, text)


SHOULD_FREE = (
    "    if is_moe and config.moe_token_dispatcher_type == \"{t}\":\n"
    "        # megatron_deepep: the experts save the dispatched rows (identity postprocess).\n"
    "        return {{\"mlp\": False, \"moe_dispatch\": False, \"moe_combine\": True}}"
    ".get(name, False)\n"
).format(t=TYPE)


def edit_should_free_input(root):
    for rel in ("megatron/core/models/common/utils.py",
                "megatron/core/models/gpt/fine_grained_callables.py"):
        path = os.path.join(root, rel)
        if not os.path.exists(path):
            continue
        text = _read(root, rel)
        if re.search(r"def should_free_input\(name, is_moe, config", text) is None:
            continue
        if f'moe_token_dispatcher_type == "{TYPE}":' in text:
            return
        text = _sub_once(
            text,
            r"(def should_free_input\(name, is_moe, config[^)]*\):\n(?:.*\n)*?"
            r"    if not is_moe:\n        return False\n)",
            lambda m: m.group(1) + SHOULD_FREE, rel, "should_free_input's dense-layer return")
        _write(root, rel, text)
        return
    raise EditError("should_free_input(name, is_moe, config, ...) not found in "
                    "megatron/core/models/{common/utils.py,gpt/fine_grained_callables.py}")


def edit_skip_padding(root):
    rel = "megatron/core/transformer/moe/moe_utils.py"
    text = _read(root, rel)
    if "def skip_routed_expert_padding" not in text or f'== "{TYPE}"' in text:
        return
    text = _sub_once(
        text,
        r"(def skip_routed_expert_padding\([^)]*\)[^:]*:\n(?:\s*\"\"\"(?:.|\n)*?\"\"\"\n)?)",
        lambda m: m.group(1) + (
            f'    if config.moe_token_dispatcher_type == "{TYPE}":\n'
            f"        # megatron_deepep pads every expert segment in its dispatch kernel.\n"
            f"        return bool(config.moe_router_padding_for_quantization)\n"),
        rel, "skip_routed_expert_padding's body")
    _write(root, rel, text)


def edit_arguments_legacy(root):
    rel = "megatron/training/arguments.py"
    text = _read(root, rel)
    text = _sub_once(
        text,
        r"'--moe-token-dispatcher-type',[^\]]*?choices=\[(?P<list>[^\]]*)\]",
        _add_to_list, rel, "the --moe-token-dispatcher-type choices", flags=re.S)
    _write(root, rel, text)


def detect_family(root):
    text = _read(root, "megatron/core/transformer/transformer_config.py")
    return "core" if re.search(DISPATCHER_FIELD + r"Literal\[", text, flags=re.M) else "legacy"


def apply_edits(root, family=None):
    family = family or detect_family(root)
    layer = _read(root, "megatron/core/transformer/moe/moe_layer.py")
    group_kw = "model_comm_pgs" if "model_comm_pgs=model_comm_pgs" in layer else "pg_collection"
    if family == "core":
        edit_config(root)
        edit_moe_layer(root, group_kw)
        edit_should_free_input(root)
        edit_skip_padding(root)
    elif family == "legacy":
        edit_arguments_legacy(root)
        edit_moe_layer(root, group_kw)
    else:
        raise EditError(f"unknown family {family!r}")
    return family


def diff(root, family=None):
    """The edits as a git patch (the tree is left unchanged)."""
    rels = ["megatron/core/transformer/transformer_config.py",
            "megatron/core/transformer/moe/moe_layer.py",
            "megatron/core/models/common/utils.py",
            "megatron/core/models/gpt/fine_grained_callables.py",
            "megatron/core/transformer/moe/moe_utils.py",
            "megatron/training/arguments.py"]
    with tempfile.TemporaryDirectory() as tmp:
        a, b = os.path.join(tmp, "a"), os.path.join(tmp, "b")
        for rel in rels:
            src = os.path.join(root, rel)
            if os.path.exists(src):
                for side in (a, b):
                    os.makedirs(os.path.dirname(os.path.join(side, rel)), exist_ok=True)
                    shutil.copy(src, os.path.join(side, rel))
        apply_edits(b, family)
        out = subprocess.run(["git", "diff", "--no-index", "--no-prefix", "a", "b"], cwd=tmp,
                             capture_output=True, text=True)
        if out.returncode not in (0, 1):
            raise RuntimeError(out.stderr)
        return re.sub(r"(^|\n)(diff --git |--- |\+\+\+ )([ab])/", r"\1\2\3/", out.stdout)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("root", help="Megatron-LM source tree (holds megatron/core)")
    parser.add_argument("--family", choices=["core", "legacy"], default=None)
    parser.add_argument("--diff", action="store_true", help="print a git patch, edit nothing")
    args = parser.parse_args(argv)
    try:
        if args.diff:
            sys.stdout.write(diff(args.root, args.family))
        else:
            print(f"edited {args.root} ({apply_edits(args.root, args.family)} family)")
    except EditError as e:
        print(f"generate.py: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
