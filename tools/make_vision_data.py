"""Write the vision demo task, the one-digit sum "a+b" drawn as an image, as chat-format prompt rows.

Each row is {"messages": [{"role": "user", "content": [IMAGE_PART, {"type": "text", "text":
QUESTION}]}], "label": "3+5=8", "metadata": {...}}, IMAGE_PART being an OpenAI content part
{"type": "image_url", "image_url": {"url": ...}}, so a ChatAgent hands the row's messages to the
OpenAI SDK as they are. The image is a 128x64 black-on-white PNG of "a+b" in Pillow's built-in
font, drawn without anti-aliasing (the same bytes on every machine with the same Pillow). 128x64
is two 64-px tiles side by side: the tiny Idefics3 (tools/make_tiny_model.py --preset vlm) reads it
as those 2 tiles plus the global one, 3 x 4 = 12 image tokens, where a square image would be
scaled up to 4 tiles plus the global one (20 tokens).

`--images embed` (the default) puts the PNG in the row as a data URI (about 0.5 kB: the rows need
nothing beside them, and every OpenAI-compatible server reads data URIs); `--images files` writes
the 100 distinct images once, to OUT_DIR/images/, and the image part's url names the file by its
path relative to OUT_DIR (the data file's directory, which Molt's loader resolves it against). Rows
have no `images` column: the image is a part of the message (Molt takes one or the other).

Problems are drawn as tools/make_demo_data.py draws them (the same problems for the same seed):
train rows uniformly, eval rows each of the 100 sums once in a seeded order. Rows are a pure
function of the arguments.

    python tools/make_vision_data.py OUT_DIR [--num-train 4096] [--num-eval 100] [--images embed|files]
"""

import argparse
import base64
import io
import json
import random
from pathlib import Path

from PIL import Image, ImageDraw, ImageFont

QUESTION = "Write out the sum shown, with its result."
# The warm start's second file, sft_unsure.jsonl: the digits always right, the result right in this
# share of rows and a near miss (1 or 2 off) in the rest, so the model it trains reads the image
# and knows roughly what each sum is, but is unsure of it (configs/demo.py:sft_vision_unsure).
UNSURE_SHARE = 0.4
NEAR_MISSES = (-2, -1, 1, 2)
IMAGE_WIDTH, IMAGE_HEIGHT = 128, 64
FONT_SIZE = 48  # digits ~32 px tall: each is most of a 32x32 region (one image token's 2x2 patches)
EVAL_LAYOUT = "each of the 100 problems once, in a seeded order"
IMAGE_LAYOUTS = ("embed", "files")


def render_sum(a: int, b: int) -> bytes:
    """The PNG bytes of "a+b", centred, black on white, in 8-bit grayscale."""
    image = Image.new("L", (IMAGE_WIDTH, IMAGE_HEIGHT), 255)
    draw = ImageDraw.Draw(image)
    draw.fontmode = "1"  # no anti-aliasing: pure black and white pixels, whatever the FreeType build
    font = ImageFont.load_default(size=FONT_SIZE)
    draw.text((IMAGE_WIDTH / 2, IMAGE_HEIGHT / 2), f"{a}+{b}", fill=0, font=font, anchor="mm")
    buffer = io.BytesIO()
    image.save(buffer, format="PNG", optimize=True)
    return buffer.getvalue()


def draw_problems(num_rows: int, rng: random.Random, split: str) -> list[tuple[int, int]]:
    """(a, b) pairs: uniform draws for training; for evaluation each of the 100 once, in a seeded
    order (repeating it past 100 rows). The same draws as tools/make_demo_data.py."""
    if split == "eval":
        problems = [(a, b) for a in range(10) for b in range(10)]
        rng.shuffle(problems)
        return [problems[index % len(problems)] for index in range(num_rows)]
    return [(rng.randrange(10), rng.randrange(10)) for _ in range(num_rows)]


def build_row(a: int, b: int, url: str, *, split: str, index: int) -> dict:
    """One prompt row: the image then the question, as one user message of OpenAI content parts."""
    content = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": QUESTION}]
    return {
        "messages": [{"role": "user", "content": content}],
        "label": equation(a, b, a + b),
        "metadata": {"split": split, "index": index, "a": a, "b": b},
    }


def make_vision_data(
    out_dir: str | Path,
    *,
    num_train: int = 4096,
    num_eval: int = 100,
    seed: int = 0,
    images: str = "embed",
) -> Path:
    """Write train.jsonl, eval.jsonl, sft.jsonl (the training rows with the reply "a+b=s") and
    sft_unsure.jsonl (the same with near misses: UNSURE_SHARE) (and
    images/ for `images="files"`) to `out_dir`; return it."""
    if images not in IMAGE_LAYOUTS:
        raise ValueError(f"unknown images layout {images!r}; choose one of {list(IMAGE_LAYOUTS)}")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    pngs = {(a, b): render_sum(a, b) for a in range(10) for b in range(10)}
    if images == "files":
        (out_dir / "images").mkdir(exist_ok=True)
        for (a, b), png in pngs.items():
            (out_dir / image_file(a, b)).write_bytes(png)
    for split, num_rows in {"train": num_train, "eval": num_eval}.items():
        # One generator per split, so the eval rows do not depend on num_train.
        pairs = draw_problems(num_rows, random.Random(f"{split}:{seed}"), split)
        with open(out_dir / f"{split}.jsonl", "w") as f:
            for index, (a, b) in enumerate(pairs):
                if images == "files":
                    url = image_file(a, b)
                else:
                    url = "data:image/png;base64," + base64.b64encode(pngs[(a, b)]).decode()
                f.write(json.dumps(build_row(a, b, url, split=split, index=index)) + "\n")
    # The warm start's rows: the training rows with the reply, "a+b=s" (configs/demo.py:sft_vision;
    # the digit tokens give the vision tower its own signal), and the same rows with the result
    # right in UNSURE_SHARE of them and a near miss in the rest (sft_vision_unsure).
    near_misses = random.Random(f"unsure:{seed}")
    with (open(out_dir / "train.jsonl") as rows, open(out_dir / "sft.jsonl", "w") as sure,
          open(out_dir / "sft_unsure.jsonl", "w") as unsure):
        for line in rows:
            row = json.loads(line)
            a, b = row["metadata"]["a"], row["metadata"]["b"]
            sure.write(json.dumps(with_reply(row, equation(a, b, a + b))) + "\n")
            unsure.write(json.dumps(with_reply(row, equation(a, b, unsure_result(a + b, near_misses)))) + "\n")
    settings = {"seed": seed, "num_train": num_train, "num_eval": num_eval, "eval": EVAL_LAYOUT, "label": "equation",
                "unsure_share": UNSURE_SHARE,
                "images": images, "image_size": [IMAGE_WIDTH, IMAGE_HEIGHT], "font_size": FONT_SIZE}
    (out_dir / "settings.json").write_text(json.dumps(settings) + "\n")
    return out_dir


def equation(a: int, b: int, result: int) -> str:
    """The reply the task asks for, and a row's label: "a+b=result"."""
    return f"{a}+{b}={result}"


def unsure_result(total: int, rng: random.Random) -> int:
    """The result a row of sft_unsure.jsonl shows: `total` in UNSURE_SHARE of draws, else a near
    miss (never negative: 0-2 becomes 0+2)."""
    if rng.random() < UNSURE_SHARE:
        return total
    miss = total + rng.choice(NEAR_MISSES)
    return miss if miss >= 0 else 2 * total - miss


def with_reply(row: dict, reply: str) -> dict:
    """A copy of a prompt row with an assistant turn holding `reply` (a chat row for molt.sft)."""
    return {**row, "messages": row["messages"] + [{"role": "assistant", "content": reply}]}


def image_file(a: int, b: int) -> str:
    """The image's path relative to the data directory."""
    return f"images/{a}_{b}.png"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out_dir", help="directory to write train/eval files into (created if missing)")
    parser.add_argument("--num-train", type=int, default=4096)
    parser.add_argument("--num-eval", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--images", default="embed", choices=IMAGE_LAYOUTS,
                        help="embed: data URIs in the rows; files: PNGs in OUT_DIR/images, named by relative path")
    args = parser.parse_args()
    out_dir = make_vision_data(args.out_dir, num_train=args.num_train, num_eval=args.num_eval, seed=args.seed,
                               images=args.images)
    for path in sorted(out_dir.glob("*.jsonl")):
        print(f"wrote {path} ({path.stat().st_size / 1e3:.1f} kB)")


if __name__ == "__main__":
    main()
