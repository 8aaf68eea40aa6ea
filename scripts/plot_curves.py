#!/usr/bin/python3
# SPDX-License-Identifier: Apache-2.0
"""Draws one benchmark curve set as an SVG with matplotlib (Debian's python3-matplotlib, which
make bench's setup installs): plot_curves.py SPEC.json OUT.svg, where SPEC holds title, ylabel,
xlabel, xs and curves [{label, medians, ranges: [[min, max], ...]}]."""
import json
import sys

import matplotlib

matplotlib.use("Agg")
matplotlib.rcParams["svg.fonttype"] = "none"  # text stays text: a small, diffable file
matplotlib.rcParams["svg.hashsalt"] = "udp-fanout"  # the same ids run after run
import matplotlib.pyplot as plt  # noqa: E402


def main(spec_path, out_path):
    with open(spec_path) as f:
        spec = json.load(f)
    xs = spec["xs"]
    figure, axes = plt.subplots(figsize=(7, 4))
    for curve in spec["curves"]:
        medians = curve["medians"]
        errors = [[m - lo for m, (lo, _) in zip(medians, curve["ranges"])], [hi - m for m, (_, hi) in zip(medians, curve["ranges"])]]
        axes.errorbar(xs, medians, yerr=errors, marker="o", capsize=3, label=curve["label"])
    axes.set_xscale("log")
    axes.set_xticks(xs)
    axes.set_xticklabels([f"{x:,}" for x in xs])
    axes.minorticks_off()
    axes.set_ylim(bottom=0)
    axes.set_title(spec["title"])
    axes.set_xlabel(spec["xlabel"])
    axes.set_ylabel(spec["ylabel"])
    axes.grid(True, alpha=0.3)
    axes.legend()
    figure.tight_layout()
    figure.savefig(out_path, metadata={"Date": None})


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
