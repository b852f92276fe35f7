"""How far two `klein bench` runs agree: for every case, each ratio the report gives (klein vs diffusers,
klein's and diffusers' fractions of the matmul peak, the KV speedups) in both runs and their relative
difference; then the largest difference per ratio.

Run: python benchmarks/speed/bench_agreement.py results-a/bench-cpu.json results-b/bench-cpu.json
"""

import argparse
import json


def ratios(run: dict) -> dict[str, dict[str, float]]:
    """Every case's ratios as the report computed them."""
    out = {}
    for case in run["cases"]:
        row = {
            "klein vs diffusers": case["klein_vs_diffusers"],
            "klein of peak": case["klein_fraction_of_peak"],
            "diffusers of peak": case["diffusers_fraction_of_peak"],
        }
        for engine, speedup in case.get("kv", {}).get("speedup", {}).items():
            row[f"KV speedup {engine}"] = speedup["transformer"]
        out[case["name"]] = row
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("first")
    parser.add_argument("second")
    args = parser.parse_args()
    runs = [json.load(open(path)) for path in (args.first, args.second)]
    peaks = [run["machine"]["matmul_peak"]["flops_per_second"] for run in runs]
    a, b = (ratios(run) for run in runs)
    print(f"matmul peak: {peaks[0] / 1e9:.1f} vs {peaks[1] / 1e9:.1f} GFLOP/s\n")
    print("| case | ratio | first | second | difference |")
    print("|---|---|---|---|---|")
    worst: dict[str, float] = {}
    for name in a:
        for ratio, first in a[name].items():
            second = b[name][ratio]
            difference = abs(second / first - 1)
            worst[ratio] = max(worst.get(ratio, 0.0), difference)
            print(f"| {name} | {ratio} | {first:.3f} | {second:.3f} | {difference:.1%} |")
    print("\n| ratio | largest difference |")
    print("|---|---|")
    for ratio, difference in worst.items():
        print(f"| {ratio} | {difference:.1%} |")


if __name__ == "__main__":
    main()
