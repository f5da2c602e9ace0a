"""Plot the loss curves of main-job runs written with ``train_llama.py --losses run.json``.

    python examples/plot_losses.py bf16.json fp8.json -o losses.png

Prints, for each run after the first, the largest and the final relative difference of its loss from
the first run's, step by step (the runs must have the same steps).
"""

import argparse
import json
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", type=Path, nargs="+", help="JSON files from train_llama.py --losses")
    parser.add_argument("-o", "--output", type=Path, default=Path("losses.png"))
    args = parser.parse_args()
    runs = {path.stem: json.loads(path.read_text())["losses"] for path in args.runs}
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
    figure.tight_layout()
    figure.savefig(args.output, dpi=120)
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
