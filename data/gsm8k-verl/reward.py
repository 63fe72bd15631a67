"""A reward function written for verl, with verl's signature for a custom reward: it reads the final number
of the reply (after "####" when there is one, else its last number) and compares it with the ground truth.
sfhpc recognises the signature and calls it as verl does; nothing here knows sfhpc."""

import re

NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    text = solution_str.rpartition("####")[2] if "####" in solution_str else solution_str
    numbers = NUMBER.findall(text)
    found = numbers[-1].replace(",", "") if numbers else None
    right = found is not None and float(found) == float(str(ground_truth).replace(",", ""))
    return {"score": 1.0 if right else 0.0, "acc": right, "data_source": data_source}
