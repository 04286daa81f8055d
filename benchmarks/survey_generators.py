"""Survey: which transformers families ``compile_generator`` serves, and how exactly.

For each family of ``tests/fixtures/hf_models.py:generator_families`` (tiny
random-init configs, fp32, nothing downloaded): build a generator
(``max_batch=3, max_length=24``), save it, then serve it in a fresh process
where ``transformers`` cannot be imported, on a left-padded batch of 3 (prompt
8, pads 0/2/5) for 8 greedy new tokens, and compare with transformers' own
``generate(..., output_logits=True)``: tokens equal, and the largest absolute
difference of the prefill's and every decode step's logits. A build that is
refused prints the error's type and first line.

Usage (repository root)::

    python benchmarks/survey_generators.py [--families cohere,mixtral] [--out DIR]

Prints one Markdown table row per family as it finishes (and the table again at
the end); exits 1 if any family fails or differs by more than 1e-4.
"""

from __future__ import annotations

import argparse
import logging
import sys
import tempfile
import time
from pathlib import Path

import torch
from harness import run_child, write_result

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

_SERVE = """
import sys
sys.modules["transformers"] = None  # not importable here
import torch
from torch_precompile import Precompile

case = torch.load(sys.argv[2])
out = Precompile.load(sys.argv[1]).generate(
    case["ids"], case["mask"], max_new_tokens=case["new"], eos_token_id=None, do_sample=False,
    return_dict_in_generate=True, output_logits=True,
)
torch.save({"sequences": out.sequences, "logits": torch.stack(out.logits)}, sys.argv[3])
"""

HEADER = "| family | built (s) | served without transformers | tokens equal | max abs diff | note |"


def _prompt() -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(3, 1000, (3, 8), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    for row, pad in enumerate((0, 2, 5)):
        ids[row, :pad], mask[row, :pad] = 0, 0
    return ids, mask


def survey_one(name: str, build, root: Path, new: int = 8) -> dict:
    """Build, save, serve in a fresh process and compare one family."""
    from torch_precompile import Precompile
    from torch_precompile.generation import compile_generator

    row = {"family": name}
    torch.manual_seed(0)
    model = build().eval()
    start = time.perf_counter()
    try:
        generator = compile_generator(model, max_batch=3, max_length=24)
    except Exception as exc:  # the survey reports every refusal
        row["note"] = f"refused: {type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
        return row
    row["built"] = round(time.perf_counter() - start, 1)
    path = root / f"{name}.pt"
    Precompile.save(path, generator)
    ids, mask = _prompt()
    with torch.no_grad():
        eager = model.generate(
            ids, attention_mask=mask, max_new_tokens=new, do_sample=False, pad_token_id=0,
            eos_token_id=None, return_dict_in_generate=True, output_logits=True,
        )  # fmt: skip
    case, result = root / f"{name}.case", root / f"{name}.out"
    torch.save({"ids": ids, "mask": mask, "new": new}, case)
    try:
        run_child(_SERVE, str(path), str(case), str(result), timeout=900)
    except RuntimeError as exc:
        last = (str(exc).strip().splitlines() or ["?"])[-1]
        row["note"] = f"serving failed: {last[:160]}"
        return row
    served = torch.load(result)
    row["served"] = True
    row["tokens_equal"] = bool(torch.equal(served["sequences"], eager.sequences))
    diff = (served["logits"] - torch.stack(eager.logits)).abs().max().item()
    row["max_abs_diff"] = diff
    if diff > 1e-4:
        row["note"] = "logits differ"
    return row


def markdown(row: dict) -> str:
    built = row.get("built", "no")
    served = "yes" if row.get("served") else ("-" if "built" not in row else "no")
    equal = {True: "yes", False: "NO"}.get(row.get("tokens_equal"), "-")
    diff = f"{row['max_abs_diff']:.1e}" if "max_abs_diff" in row else "-"
    return f"| {row['family']} | {built} | {served} | {equal} | {diff} | {row.get('note', '')} |"


def main() -> int:
    from tests.fixtures.hf_models import generator_families

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", help="comma-separated names (default: all)")
    parser.add_argument("--out", help="folder for the files and results.json (default: temp)")
    args = parser.parse_args()
    logging.getLogger("torch_precompile").setLevel(logging.ERROR)
    families = generator_families()
    names = args.families.split(",") if args.families else list(families)
    root = Path(args.out or tempfile.mkdtemp(prefix="survey_generators_"))
    root.mkdir(parents=True, exist_ok=True)
    print(f"torch {torch.__version__}; files in {root}", flush=True)
    print(HEADER + "\n|---|---|---|---|---|---|", flush=True)
    rows = []
    for name in names:
        rows.append(survey_one(name, families[name], root))
        print(markdown(rows[-1]), flush=True)
        write_result(root / "results.json", {"rows": rows})
    print("\n" + HEADER + "\n|---|---|---|---|---|---|\n" + "\n".join(map(markdown, rows)))
    ok = all(r.get("tokens_equal") and r.get("max_abs_diff", 1) <= 1e-4 for r in rows)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
