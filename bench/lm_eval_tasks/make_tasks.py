"""Writes the two small local task files of bench/lm_eval_tasks (run once; the files are committed):

mc.jsonl       24 general-knowledge questions with four choices (lm-eval multiple_choice:
               log-likelihood of each choice after the question, through /v1/completions
               with echo + logprobs)
passkey.jsonl  24 pass-key prompts of about 1,000 tokens, the key at depths 0-100 %
               (kvrun needle's passkey prompts, generate_until: the server generates)

  python bench/lm_eval_tasks/make_tasks.py
"""

from __future__ import annotations

import json
from pathlib import Path

from kvrun.run.runtime import load_runtime
from kvrun.tasks import needle as nd
from kvrun.tasks.passkey import filler_units

HERE = Path(__file__).parent

MC = [
    ("What is the capital of France?", ["Paris", "Berlin", "Madrid", "Rome"], 0),
    ("How many days are in a week?", ["Five", "Six", "Seven", "Eight"], 2),
    ("What color is the sky on a clear day?", ["Green", "Blue", "Red", "Black"], 1),
    ("Which animal is known as the king of the jungle?", ["Mouse", "Cow", "Lion", "Fish"], 2),
    ("What do bees make?", ["Milk", "Honey", "Bread", "Wool"], 1),
    ("What is frozen water called?", ["Steam", "Ice", "Sand", "Smoke"], 1),
    ("How many legs does a spider have?", ["Four", "Six", "Eight", "Ten"], 2),
    ("Which planet do we live on?", ["Mars", "Venus", "Earth", "Jupiter"], 2),
    ("What is the largest ocean on Earth?", ["Atlantic", "Indian", "Arctic", "Pacific"], 3),
    ("What gas do plants take in from the air?", ["Carbon dioxide", "Helium", "Neon", "Argon"], 0),
    ("What is 2 plus 2?", ["Three", "Four", "Five", "Six"], 1),
    ("Which season comes after winter?", ["Autumn", "Summer", "Spring", "Winter"], 2),
    ("What is the opposite of hot?", ["Warm", "Cold", "Loud", "Tall"], 1),
    ("Which organ pumps blood through the body?", ["Liver", "Lung", "Heart", "Brain"], 2),
    ("What do you use to write on paper?", ["A spoon", "A pen", "A plate", "A shoe"], 1),
    ("Which fruit is yellow and curved?", ["Apple", "Grape", "Banana", "Cherry"], 2),
    ("What is the capital of Japan?", ["Seoul", "Beijing", "Tokyo", "Bangkok"], 2),
    ("How many hours are in a day?", ["12", "24", "36", "48"], 1),
    ("Which is the fastest land animal?", ["Cheetah", "Turtle", "Snail", "Sheep"], 0),
    ("What do cows drink?", ["Oil", "Water", "Juice", "Coffee"], 1),
    ("Which language is spoken in Spain?", ["French", "German", "Spanish", "Italian"], 2),
    ("What is the boiling point of water in Celsius?", ["50", "100", "150", "200"], 1),
    ("Which shape has three sides?", ["Square", "Circle", "Triangle", "Hexagon"], 2),
    ("Where does the sun rise?", ["In the west", "In the east", "In the north", "Underground"], 1),
]


def main() -> None:
    with (HERE / "mc.jsonl").open("w") as f:
        for q, choices, answer in MC:
            f.write(json.dumps({"question": q, "choices": choices, "answer": answer}) + "\n")
    rt = load_runtime(None, "float32", "cpu", log=lambda m: None, wtype="f32")
    encode = rt.tokenizer.encode
    task = nd.NeedleTask("passkey", filler_units(), encode, seed=7)
    cells = nd.grid([1000], [0, 10, 25, 40, 50, 60, 75, 90, 100, 33, 66, 80], 2)
    with (HERE / "passkey.jsonl").open("w") as f:
        for cell in cells:
            exp = task.expected(cell)
            p = task.prompt(cell, exp)
            f.write(json.dumps({"prompt": p.text, "answer": exp["answer"],
                                "depth": cell.depth, "tokens": len(p.ids)}) + "\n")  # fmt: skip
    print(f"wrote {len(MC)} + {len(cells)} documents to {HERE}")


if __name__ == "__main__":
    main()
