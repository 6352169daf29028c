"""Write launcher/data/lengths/alpaca.json: Alpaca's example lengths, read from a published figure.

tloen/alpaca-lora's `lengths.ipynb` tokenizes Stanford Alpaca's 52,002 examples (alpaca_data.json)
with the LLaMA tokenizer (BOS and EOS added) in the Alpaca prompt template, the template torchtune's
alpaca datasets use, and plots "Number of fully covered examples as a function of max length": the
count of examples of at most x tokens for x = 0 .. the longest example. That curve is the length
distribution. This script reads it from the figure's pixels, the notebook being the only published
record of those lengths here (the dataset itself is not on this machine):

    git -C <alpaca-lora clone> show 1310547f9fee5edcef72575e8c7c50d0f4e7afad:lengths.ipynb > lengths.ipynb
    python scripts/length_profile.py lengths.ipynb

The axes are located from their tick marks (x ticks every 200 tokens from 0, y ticks every 10,000
examples from 0, as labelled in the figure); each pixel column of the curve gives one point, at
the middle of the line's stroke. Resolution: about 2.9 tokens and 155 examples (0.3%) per pixel,
so the tail above about 450 tokens (the last ~150 examples) is one or two pixels high; the curve
ends at the longest example.
"""
from __future__ import annotations

import argparse
import base64
import io
import json
import sys
from pathlib import Path

import numpy as np
from PIL import Image

OUT = Path(__file__).resolve().parent.parent / "launcher" / "data" / "lengths" / "alpaca.json"
SOURCE = ("tloen/alpaca-lora lengths.ipynb @1310547f (2023-03-27), figure 'Number of fully covered "
          "examples as a function of max length': Stanford Alpaca's 52,002 examples (alpaca_data.json) "
          "tokenized by the LLaMA tokenizer with BOS and EOS in the Alpaca prompt template, read from "
          "the figure's pixels by scripts/length_profile.py (about 2.9 tokens and 0.3% of examples per pixel)")
X_TICK, Y_TICK = 200, 10000  # the figure's tick spacing: tokens, examples


def figure(notebook: Path, title: str) -> np.ndarray:
    """The RGB pixels of the notebook's output image of the cell that plots `title`."""
    for cell in json.loads(notebook.read_text())["cells"]:
        if title in "".join(cell.get("source", "")):
            for out in cell.get("outputs", []):
                png = out.get("data", {}).get("image/png")
                if png:
                    return np.asarray(Image.open(io.BytesIO(base64.b64decode(png))).convert("RGB")).astype(int)
    raise SystemExit(f"error: no figure titled {title!r} in {notebook}")


def ticks(dark: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Pixel positions of the x ticks (below the frame) and y ticks (left of it)."""
    rows = np.nonzero(dark.sum(1) > 0.5 * dark.shape[1])[0]  # the frame's horizontal edges
    cols = np.nonzero(dark.sum(0) > 0.5 * dark.shape[0])[0]  # its vertical edges
    bottom, left = rows.max(), cols.min()
    xt = np.nonzero(dark[bottom + 2: bottom + 6].sum(0) >= 3)[0]
    yt = np.nonzero(dark[:, left - 6: left - 1].sum(1) >= 3)[0]
    return xt, yt[yt > rows.min()]  # below the top edge (the y axis' exponent label is above it)


def cdf(img: np.ndarray) -> list[list[float]]:
    """[[tokens, fraction of examples with at most that many tokens], ...] along the curve."""
    dark = img.sum(2) < 300
    xt, yt = ticks(dark)
    x0, px_per_token = xt[0], (xt[-1] - xt[0]) / (X_TICK * (len(xt) - 1))
    y0, px_per_example = yt.max(), (yt.max() - yt.min()) / (Y_TICK * (len(yt) - 1))
    blue = (np.abs(img - np.array([31, 119, 180])) < 40).all(2)  # matplotlib's first line colour
    points = []
    for x in range(img.shape[1]):
        ys = np.nonzero(blue[:, x])[0]
        if len(ys):
            points.append(((x - x0) / px_per_token, (y0 - 0.5 * (ys.min() + ys.max())) / px_per_example))
    tokens = np.array([p[0] for p in points])
    count = np.maximum.accumulate(np.clip([p[1] for p in points], 0, None))
    frac = count / count[-1]
    keep = np.r_[True, np.diff(frac) > 0]  # one point per rise of the curve, and its end
    keep[-1] = True
    return [[round(float(t), 1), round(float(f), 5)] for t, f in zip(tokens[keep], frac[keep]) if t >= 0]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("notebook", type=Path, help="tloen/alpaca-lora's lengths.ipynb")
    ap.add_argument("--out", type=Path, default=OUT)
    a = ap.parse_args(argv)
    points = cdf(figure(a.notebook, "fully covered examples"))
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps({"source": SOURCE, "examples": 52002, "cdf": points}, indent=None) + "\n")
    print(f"{a.out}: {len(points)} points, longest example {points[-1][0]:.0f} tokens, "
          f"median {next(t for t, f in points if f >= 0.5):.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
