"""Generate recipes/data/lowvram_shapes.jsonl and its images (recipes/data/shapes/*.png): a tiny
image + text set (format image_chat) of coloured shapes on plain backgrounds, each row one image,
a question and the answer that describes the image exactly. Deterministic (seed 2025), PIL only.

Usage: python recipes/data/make_lowvram_shapes.py recipes/data/lowvram_shapes.jsonl
"""
import json
import random
import sys
from pathlib import Path

from PIL import Image, ImageDraw

COLOURS = {"red": (220, 40, 40), "green": (40, 170, 60), "blue": (40, 80, 220), "yellow": (240, 210, 40),
           "black": (20, 20, 20), "white": (245, 245, 245)}
SHAPES = ("square", "circle", "triangle")
PLACES = {"top left": (0, 0), "top right": (1, 0), "bottom left": (0, 1), "bottom right": (1, 1)}
QUESTIONS = ("What is in the picture?", "Describe the image.", "Which shape do you see, and where is it?")
SIDE = 64
ROWS = 24


def draw(shape: str, colour: str, place: str, background: str) -> Image.Image:
    img = Image.new("RGB", (SIDE, SIDE), COLOURS[background])
    d = ImageDraw.Draw(img)
    qx, qy = PLACES[place]
    x0, y0 = 4 + qx * SIDE // 2, 4 + qy * SIDE // 2
    box = [x0, y0, x0 + SIDE // 2 - 8, y0 + SIDE // 2 - 8]
    fill = COLOURS[colour]
    if shape == "square":
        d.rectangle(box, fill=fill)
    elif shape == "circle":
        d.ellipse(box, fill=fill)
    else:
        d.polygon([(box[0], box[3]), (box[2], box[3]), ((box[0] + box[2]) // 2, box[1])], fill=fill)
    return img


def main(out: Path) -> None:
    rng = random.Random(2025)
    folder = out.parent / "shapes"
    folder.mkdir(parents=True, exist_ok=True)
    with open(out, "w") as f:
        for i in range(ROWS):
            shape, place = rng.choice(SHAPES), rng.choice(list(PLACES))
            colour, background = rng.sample(list(COLOURS), 2)
            name = f"shapes/{i:02d}_{colour}_{shape}.png"
            draw(shape, colour, place, background).save(out.parent / name, optimize=True)
            answer = f"A {colour} {shape} in the {place} corner, on a {background} background."
            f.write(json.dumps({
                "messages": [
                    {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": rng.choice(QUESTIONS)}]},
                    {"role": "assistant", "content": [{"type": "text", "text": answer}]},
                ],
                "images": [name],
            }) + "\n")


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "recipes/data/lowvram_shapes.jsonl"))
