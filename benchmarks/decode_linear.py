"""Decode-sized linear products: W x^T (``lora.weight_major_product``) and a oneDNN-packed
weight (``lora.PackedWeights``, what the engine's inference products read where oneDNN
works) vs ``nn.Linear``'s x W^T.

For each linear shape of the bundled model and a few row counts (the rows of one decode
step), 30 distinct weights are multiplied in turn, so they come from beyond a core's own
caches as in a real step. Both forms run interleaved in one process. A shape's gain here
need not hold in the model, where each product's form also sets the layout of the next
one's input (machine C: the down projection 0.64x alone at 8 rows, yet W x^T for every
product ran sampling 1.25x as fast). So the engine decides per band of rows by timing the
whole model in each form (``lora.decide_few_row_forms``) where it does not pack weights;
those decisions on the bundled model are printed last, its gains logged.

    RESULT decode_linear_<out>x<in>_rows<r> ours=<products/s as W x^T> baseline=<products/s as x W^T> ratio=...
    RESULT decode_linear_packed_<out>x<in>_rows<r> ours=<products/s packed> baseline=<as x W^T> ratio=...
    FORM engine_takes_weight_major_at_rows=<the bands where the bundled model, unpacked, takes W x^T>

Run: .venv/bin/python benchmarks/decode_linear.py [--repeats 9]
"""

from __future__ import annotations

import argparse
import logging

import torch
from common import Timings, bundled_folder, result, timed_pair
from transformers import AutoConfig

from trio_engine import DEFAULT_MODEL, ModelHost, lora
from trio_engine.sampler import decide_product_forms

LAYERS = 30  # distinct weights per shape: more than a core's own caches hold


def shapes() -> list[tuple[int, int]]:
    """(out, in) of the bundled model's linears: q/o, k/v, gate/up, down, the head."""
    config = AutoConfig.from_pretrained(bundled_folder())
    hidden, head_dim = config.hidden_size, config.hidden_size // config.num_attention_heads
    return [(hidden, hidden), (config.num_key_value_heads * head_dim, hidden),
            (config.intermediate_size, hidden), (hidden, config.intermediate_size), (config.vocab_size, hidden)]


def compare(layers: list[torch.nn.Linear], rows: int, repeats: int, packed: bool) -> Timings:
    """Timings of a pass over ``layers`` on ``rows`` rows: W x^T or from packed weights
    ("ours"), the layer's own ("baseline")."""
    x = torch.randn(rows, layers[0].in_features)
    copies = [lora.pack(layer.weight) for layer in layers] if packed else []
    ours = ((lambda: [lora.packed_product(w, None, x) for w in copies]) if packed
            else (lambda: [lora.weight_major_product(x, layer.weight, None) for layer in layers]))
    with torch.no_grad():
        return timed_pair(ours, lambda: [layer(x) for layer in layers], repeats)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--rows", default="1,2,4,8,16,32,64")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="# %(message)s")  # the engine's measured gains
    for out_f, in_f in shapes():
        count = LAYERS if out_f * in_f < 10**7 else 2  # the head: two copies outgrow any cache
        layers = [torch.nn.Linear(in_f, out_f, bias=False) for _ in range(count)]
        for rows in map(int, args.rows.split(",")):
            for packed, name in ((False, "decode_linear"), (True, "decode_linear_packed")):
                timings = compare(layers, rows, args.repeats, packed)
                result(f"{name}_{out_f}x{in_f}_rows{rows}", count / timings["ours"], count / timings["baseline"],
                       " (products/s)", timings.spread())
    host = ModelHost(DEFAULT_MODEL, dtype=torch.float32)
    host.routing.packed.enabled = False  # the trial is for a host whose weights are not packed
    for band in lora.FEW_ROW_BANDS:
        decide_product_forms(host, band, None)
    bands = [band for band in lora.FEW_ROW_BANDS if host.routing.few_row_forms[band]]
    print(f"FORM engine_takes_weight_major_at_rows={','.join(map(str, bands)) or 'none'}", flush=True)


if __name__ == "__main__":
    main()
