"""The fast decoder's self-check against the uncached reference decoder:

    python -m primerl.inference.engines.llama_check [cpu|cuda] [--compile]
"""

from __future__ import annotations

import torch

from primerl.inference.engines.llama import LlamaDecoder


def self_check(model_name: str = "tiny", device: str = "cpu", steps: int = 24, compile: bool = False) -> None:
    """The fast decoder's greedy tokens must equal the uncached reference's, for rows of different lengths decoded
    together (with rows retiring mid-way, which moves rows; two rows share a prompt, which prefill runs once), on
    CUDA through captured graphs, and with `compile` through the compiled decode step."""
    from transformers import AutoModelForCausalLM

    from primerl.inference.engines.decoders import ReferenceDecoder
    from primerl.models import resolve_model

    model = AutoModelForCausalLM.from_pretrained(resolve_model(model_name), dtype=torch.float32).to(device).eval()
    graphs = device.startswith("cuda")
    prompts = [[1, 17, 45, 300, 12], [1, 99], [1, *range(5, 40)], [1, 512, 3], [1, 99]]
    rows_max = len(prompts)
    outputs = []
    for decoder in (ReferenceDecoder(model, rows_max), LlamaDecoder(model, rows_max, 256, cuda_graphs=graphs, compile=compile)):
        sequences = [list(p) for p in prompts]
        rows = list(range(len(prompts)))  # rows[i] = prompt index decoded in row i
        tokens = decoder.prefill(0, prompts).argmax(-1).tolist()
        for step in range(steps):
            for row, token in zip(rows, tokens, strict=True):
                sequences[row].append(token)
            if step == steps // 2:  # retire row 1: the last row moves into its place
                decoder.move_row(len(rows) - 1, 1, len(sequences[rows[-1]]))
                rows[1] = rows.pop()
                tokens[1] = tokens.pop()
            positions = [len(sequences[row]) - 1 for row in rows]
            tokens = decoder.decode(tokens, positions).argmax(-1).tolist()
        outputs.append(sequences)
    assert outputs[0] == outputs[1], f"fast decoder differs from the reference:\n{outputs[0]}\n{outputs[1]}"
    # several steps per call, sampling on the device (greedy rows), through the sampling graphs on CUDA
    fast = LlamaDecoder(model, rows_max, 256, cuda_graphs=graphs, compile=compile)
    chained = [list(p) for p in prompts]
    tokens = fast.prefill(0, prompts).argmax(-1).tolist()
    for _ in range(3):
        for sequence, token in zip(chained, tokens, strict=True):
            sequence.append(token)
        positions = [len(sequence) - 1 for sequence in chained]
        zeros = torch.zeros(len(prompts))
        sampled, _ = fast.decode_many(tokens, positions, zeros, torch.full((steps // 3, len(prompts)), 0.5).double())
        columns = sampled.T.tolist()
        for sequence, column in zip(chained, columns, strict=True):
            sequence.extend(column[:-1])
        tokens = [column[-1] for column in columns]
    reference = ReferenceDecoder(model, rows_max)
    expected = [list(p) for p in prompts]
    tokens = reference.prefill(0, prompts).argmax(-1).tolist()
    for _ in range(len(chained[0]) - len(prompts[0])):
        for sequence, token in zip(expected, tokens, strict=True):
            sequence.append(token)
        tokens = reference.decode(tokens, [len(s) - 1 for s in expected]).argmax(-1).tolist()
    assert chained == expected, f"chained decode differs from the reference:\n{expected}\n{chained}"
    print(f"ok: fast greedy decode equals the uncached reference ({model_name}, {device}, {steps} steps, "
          f"one step and {steps // 3} steps per call{', compiled' if compile else ''})")


if __name__ == "__main__":
    import sys

    self_check(device=sys.argv[1] if len(sys.argv) > 1 else "cpu", compile="--compile" in sys.argv)
