"""Plot the loss curves of main-job runs written with ``train_llama.py --losses run.json`` or ``--metrics
run.jsonl`` (one JSON object per step; the lr is drawn too).

    python examples/plot_losses.py bf16.json fp8.json -o losses.png
    python examples/plot_losses.py wsd.jsonl cosine.jsonl -o losses.png

Prints, for each run after the first, the largest and the final relative difference of its loss from
the first run's, step by step (the runs must have the same steps).
"""

import argparse
import json
from pathlib import Path


def read_run(path: Path) -> tuple[list[float], list[float] | None]:
    """(losses, lrs or None) of a --losses JSON file or a --metrics JSON-lines file."""
    if path.suffix == ".jsonl":  # appended to by every run (a resumed one too): the last line of each step
        by_step = {}
        for line in path.read_text().splitlines():
            if line.strip():
                metrics = json.loads(line)
                by_step[metrics["step"]] = metrics
        steps = [by_step[step] for step in sorted(by_step)]
        return [s["loss"] for s in steps], [s["lr"] for s in steps]
    return json.loads(path.read_text())["losses"], None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", type=Path, nargs="+", help="train_llama.py --losses (.json) or --metrics (.jsonl)")
    parser.add_argument("-o", "--output", type=Path, default=Path("losses.png"))
    args = parser.parse_args()
    read = {path.stem: read_run(path) for path in args.runs}
    runs = {name: losses for name, (losses, _) in read.items()}
    names = list(runs)
    base = runs[names[0]]
    for name in names[1:]:
        if len(runs[name]) != len(base):
            raise SystemExit(f"{name} has {len(runs[name])} steps, {names[0]} has {len(base)}")
        gaps = [abs(a - b) / abs(b) for a, b in zip(runs[name], base)]
        print(f"{name} vs {names[0]}: largest relative loss difference {max(gaps):.2e}, at the last step "
              f"{gaps[-1]:.2e}")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(7, 4))
    for name, losses in runs.items():
        axes.plot(range(len(losses)), losses, label=name, linewidth=1)
    axes.set_xlabel("step")
    axes.set_ylabel("loss")
    axes.legend()
    schedules = {name: lrs for name, (_, lrs) in read.items() if lrs is not None}
    if schedules:
        lr_axes = axes.twinx()
        for name, lrs in schedules.items():
            lr_axes.plot(range(len(lrs)), lrs, linestyle=":", linewidth=1, label=f"{name} lr")
        lr_axes.set_ylabel("lr (dotted)")
    figure.tight_layout()
    figure.savefig(args.output, dpi=120)
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
