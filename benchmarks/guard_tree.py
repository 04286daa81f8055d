"""Print the parts of Dynamo's guard tree that the lean (Dynamo-free) guards cannot express.

A diagnostic for the lean load: compiles one model through ``Precompile.compile``
and walks the compiled function's guard manager, printing, for each node the
lean-guard translation refuses, its source, accessor and leaf code parts.

Usage::

    python benchmarks/guard_tree.py transformer|gpt|gpt2|llama [--device cuda] [--all]
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from torch_precompile import Precompile  # noqa: E402
from torch_precompile._compat import lean_guard_spec as spec_mod  # noqa: E402


def build(name: str, device: str) -> tuple[torch.nn.Module, tuple, dict]:
    if name in ("transformer", "gpt"):
        from tests.fixtures import models

        model, args, kwargs = models.BUILDERS[name]()
    else:  # small random-init configs of the suite's HF models (benchmarks/coldstart_cuda.py)
        import transformers as T

        torch.manual_seed(0)
        if name == "gpt2":
            model = T.GPT2LMHeadModel(T.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=1000))
        else:
            cfg = T.LlamaConfig(
                hidden_size=64,
                intermediate_size=128,
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=2,
                vocab_size=1000,
            )
            model = T.LlamaForCausalLM(cfg)
        model = model.eval()
        args, kwargs = (torch.randint(0, 1000, (2, 64)),), {"use_cache": False}
    model = model.to(device)
    move = lambda v: v.to(device) if isinstance(v, torch.Tensor) else v  # noqa: E731
    return model, tuple(move(a) for a in args), {k: move(v) for k, v in kwargs.items()}


def walk(manager: object, depth: int, show_all: bool, out: list[str]) -> None:
    pad = "  " * depth
    bad_leaves = []
    for leaf in manager.get_leaf_guards():
        try:
            spec_mod._light_leaf(leaf, None, False)
            ok = True
        except Exception as exc:
            ok = False
            bad_leaves.append(f"{type(leaf).__name__}: {exc}")
        if show_all and ok:
            out.append(f"{pad}  leaf {type(leaf).__name__}: {leaf.verbose_code_parts()[0][:160]}")
    for text in bad_leaves:
        out.append(f"{pad}  REFUSED leaf {text[:300]}")
    for accessor, child in zip(manager.get_accessors(), manager.get_child_managers()):
        try:
            spec_mod._light_step(accessor)
            mark = ""
        except Exception:
            mark = "REFUSED "
        if show_all or mark:
            out.append(f"{pad}{mark}{accessor.repr()[:160]} -> {child.get_source()[:160]}")
        walk(child, depth + 1, show_all or bool(mark), out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--all", action="store_true")
    args = parser.parse_args()
    model, inputs, kwargs = build(args.model, args.device)
    with torch.no_grad():
        artifact = Precompile.compile(model, inputs, kwargs)
    manager = artifact.compiled_function._artifacts.guard_manager
    root = manager.root
    out: list[str] = [f"torch {torch.__version__} model {args.model} on {args.device}"]
    for g in root.get_epilogue_lambda_guards():
        out.append(f"epilogue {type(g).__name__}: {g.verbose_code_parts()}")
    walk(root, 0, args.all, out)
    print("\n".join(out))
    spec = spec_mod.lean_guard_spec(manager, model)
    print("lean guards:", "yes" if spec is not None else "no")


if __name__ == "__main__":
    main()
