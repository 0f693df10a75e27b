"""Generate recipes/data/lowvram_instruct.jsonl (lowvram quickstart set). Deterministic.

Usage: python recipes/data/make_lowvram_instruct.py recipes/data/lowvram_instruct.jsonl
"""
import json
import random
import sys
from decimal import ROUND_HALF_UP, Decimal

rng = random.Random(2024)
rows = []


def add(instruction, output, inp=""):
    instruction = instruction.replace(" a 8", " an 8")  # "an 8B model", "an 80 ..."
    rows.append({"instruction": instruction, "input": inp, "output": output})


def num(x, places=2):
    """Format a Decimal: thousands separators, at most `places` decimals, no trailing zeros."""
    d = Decimal(x).quantize(Decimal(1).scaleb(-places), rounding=ROUND_HALF_UP)
    s = f"{d:,.{places}f}"
    if "." in s:
        s = s.rstrip("0").rstrip(".")
    return s


def is_exact(x, places=2):
    d = Decimal(x)
    return d == d.quantize(Decimal(1).scaleb(-places))


# ---------------------------------------------------------------- unit conversions
UNITS = [
    # (from singular, from plural, to singular, to plural, factor, explanation)
    ("kilometre", "kilometres", "metre", "metres", Decimal(1000), "One kilometre is 1,000 metres, so multiply by 1,000."),
    ("metre", "metres", "centimetre", "centimetres", Decimal(100), "One metre is 100 centimetres, so multiply by 100."),
    ("kilogram", "kilograms", "gram", "grams", Decimal(1000), "One kilogram is 1,000 grams, so multiply by 1,000."),
    ("litre", "litres", "millilitre", "millilitres", Decimal(1000), "One litre is 1,000 millilitres, so multiply by 1,000."),
    ("hour", "hours", "minute", "minutes", Decimal(60), "One hour is 60 minutes, so multiply by 60."),
    ("minute", "minutes", "second", "seconds", Decimal(60), "One minute is 60 seconds, so multiply by 60."),
    ("day", "days", "hour", "hours", Decimal(24), "One day is 24 hours, so multiply by 24."),
    ("week", "weeks", "day", "days", Decimal(7), "One week is 7 days, so multiply by 7."),
    ("foot", "feet", "inch", "inches", Decimal(12), "One foot is 12 inches, so multiply by 12."),
    ("inch", "inches", "centimetre", "centimetres", Decimal("2.54"), "One inch is exactly 2.54 centimetres, so multiply by 2.54."),
    ("mile", "miles", "kilometre", "kilometres", Decimal("1.609344"), "One mile is exactly 1.609344 kilometres, so multiply by 1.609344."),
    ("pound", "pounds", "kilogram", "kilograms", Decimal("0.45359237"), "One pound is exactly 0.45359237 kilograms, so multiply by 0.45359237."),
    ("gibibyte", "gibibytes", "mebibyte", "mebibytes", Decimal(1024), "One gibibyte (GiB) is 1,024 mebibytes (MiB), so multiply by 1,024."),
    ("gigabyte", "gigabytes", "megabyte", "megabytes", Decimal(1000), "One gigabyte (GB) is 1,000 megabytes (MB), so multiply by 1,000."),
    ("metre", "metres", "millimetre", "millimetres", Decimal(1000), "One metre is 1,000 millimetres, so multiply by 1,000."),
    ("gram", "grams", "milligram", "milligrams", Decimal(1000), "One gram is 1,000 milligrams, so multiply by 1,000."),
]
CONV_TEMPLATES = [
    "Convert {v} {f} to {t}.",
    "How many {t} are in {v} {f}?",
    "Express {v} {f} in {t}.",
]
seen = set()
for fs, fp, ts, tp, factor, why in UNITS:
    values = rng.sample([1, 2, 3, 4, 5, 6, 8, 10, 12, 15, 20, 25, 50], 5)
    for v in values:
        if (fs, v) in seen:
            continue
        seen.add((fs, v))
        res = Decimal(v) * factor
        f = fs if v == 1 else fp
        t = ts if res == 1 else tp
        tmpl = rng.choice(CONV_TEMPLATES)
        approx = "" if is_exact(res) else "about "
        add(tmpl.format(v=v, f=f, t=tp), f"{v} {f} is {approx}{num(res)} {t}. {why}")

# Celsius to Fahrenheit
for c in [0, 10, 20, 25, 30, 37, 40, 100, -10, 15]:
    fahr = Decimal(c) * 9 / 5 + 32
    add(rng.choice(["Convert {c} degrees Celsius to Fahrenheit.", "What is {c} °C in °F?"]).format(c=c),
        f"{c} °C is {num(fahr, 1)} °F. Multiply by 9/5 and add 32.")

# ---------------------------------------------------------------- arithmetic word problems
ITEMS = [("box", "boxes", "pencils"), ("bag", "bags", "apples"), ("crate", "crates", "bottles"),
         ("shelf", "shelves", "books"), ("tray", "trays", "cupcakes"), ("pack", "packs", "batteries")]
for _ in range(24):
    cs, cp, item = rng.choice(ITEMS)
    per = rng.randint(3, 24)
    n = rng.randint(2, 15)
    add(f"A {cs} holds {per} {item}. How many {item} are in {n} {cp}?",
        f"There are {per * n} {item}. {n} {cp} times {per} {item} per {cs} is {per * n}.")
NAMES = ["Ana", "Ben", "Chen", "Dara", "Eli", "Fatima", "Goran", "Hana", "Ivan", "Jade", "Kofi", "Lena"]
for _ in range(22):
    name = rng.choice(NAMES)
    start = rng.randint(20, 90)
    spent = rng.randint(3, start - 5)
    add(f"{name} has {start} euros and spends {spent} euros. How much money is left?",
        f"{name} has {start - spent} euros left. {start} minus {spent} is {start - spent}.")
for _ in range(22):
    total = rng.choice([12, 18, 20, 24, 30, 36, 40, 42, 48, 56, 60, 72, 84, 90, 96])
    k = rng.choice([d for d in [2, 3, 4, 5, 6, 7, 8, 12] if total % d == 0])
    item = rng.choice(["cookies", "stickers", "marbles", "cards", "sweets"])
    add(f"{total} {item} are shared equally among {k} children. How many does each child get?",
        f"Each child gets {total // k} {item}. {total} divided by {k} is {total // k}.")
for _ in range(20):
    speed = rng.choice([40, 50, 60, 70, 80, 90, 100, 120])
    hours = rng.choice([2, 3, 4, 5, Decimal("1.5"), Decimal("2.5")])
    dist = speed * hours
    add(f"A train travels at {speed} km/h for {num(hours)} hours. How far does it go?",
        f"It travels {num(dist)} km. Distance is speed times time: {speed} × {num(hours)} = {num(dist)}.")
for _ in range(14):
    price = rng.choice([20, 40, 60, 80, 120, 160, 200, 240])
    pct = rng.choice([10, 20, 25, 50])
    off = price * pct // 100
    assert price * pct % 100 == 0
    add(f"A jacket costs {price} dollars and is {pct}% off. What is the sale price?",
        f"The sale price is {price - off} dollars. {pct}% of {price} is {off}, and {price} minus {off} is {price - off}.")

# ---------------------------------------------------------------- primes and parity
def factor(n):
    for p in range(2, int(n ** 0.5) + 1):
        if n % p == 0:
            return p, n // p
    return None


for n in rng.sample(range(11, 200), 26):
    f = factor(n)
    if f:
        add(f"Is {n} a prime number?", f"No, {n} is not prime. It equals {f[0]} × {f[1]}.")
    else:
        add(f"Is {n} a prime number?", f"Yes, {n} is prime. No whole number other than 1 and {n} divides it.")

# ---------------------------------------------------------------- GPU memory arithmetic
SIZES = [("135M", Decimal("0.135")), ("360M", Decimal("0.36")), ("0.5B", Decimal("0.5")),
         ("1B", Decimal(1)), ("1.5B", Decimal("1.5")), ("3B", Decimal(3)), ("7B", Decimal(7)),
         ("8B", Decimal(8)), ("13B", Decimal(13)), ("70B", Decimal(70))]
PRECISIONS = [("fp32", Decimal(4), "4 bytes"), ("bf16", Decimal(2), "2 bytes"),
              ("int8", Decimal(1), "1 byte"), ("4-bit", Decimal("0.5"), "half a byte")]


def gb(billions_of_bytes):
    return f"{num(billions_of_bytes)} GB"


for label, b in SIZES:
    for prec, per, words in rng.sample(PRECISIONS, 3):
        add(rng.choice(["How much memory do the weights of a {l}-parameter model take in {p}?",
                        "Estimate the weight memory of a {l}-parameter model stored in {p}."]).format(l=label, p=prec),
            f"About {gb(b * per)}. Each parameter takes {words} in {prec}, and the model has {num(b, 3)} billion parameters.")
    add(f"How much GPU memory does full fine-tuning of {'an' if label.startswith('8') else 'a'} {label} model with AdamW and mixed precision need?",
        f"About {gb(b * 16)} before activations. Mixed-precision AdamW keeps about 16 bytes per parameter: weights, gradients, an fp32 master copy and two optimizer states.")
for label, b in SIZES[:8]:
    art = "an" if label.startswith("8") else "a"
    add(f"How much memory do the AdamW optimizer states of {art} {label} model take in fp32?",
        f"About {gb(b * 8)}. AdamW keeps two fp32 states per trained parameter, 8 bytes in all.")

# ---------------------------------------------------------------- definitions (hand-written)
DEFS = [
    ("LoRA", "LoRA trains small low-rank adapter matrices instead of the full weights. The base model stays frozen, so far fewer parameters need gradients and optimizer states."),
    ("QLoRA", "QLoRA is LoRA on top of a base model quantized to 4 bits. The frozen base takes about a quarter of its bf16 memory while the adapters train in higher precision."),
    ("gradient checkpointing", "Gradient checkpointing stores only some activations and recomputes the rest during the backward pass. It saves much activation memory at the cost of roughly 20 to 30 percent slower steps."),
    ("gradient accumulation", "Gradient accumulation sums gradients over several small batches before one optimizer step. It gives the effect of a large batch without holding it in memory at once."),
    ("mixed precision training", "Mixed precision training runs most math in 16-bit floats while keeping sensitive values in 32-bit. It speeds up training and cuts activation memory."),
    ("bf16", "bf16 (bfloat16) is a 16-bit float format with the same exponent range as fp32. It rarely overflows, so it usually needs no loss scaling."),
    ("fp16", "fp16 is a 16-bit float format with a small exponent range. Training in fp16 needs loss scaling to keep small gradients from becoming zero."),
    ("a learning rate", "The learning rate sets how big each optimizer update is. Too high makes training unstable, too low makes it slow."),
    ("an epoch", "An epoch is one full pass over the training data. Training for three epochs shows every example three times."),
    ("batch size", "The batch size is the number of examples used for one optimizer step. Larger batches give smoother gradients but need more memory or more accumulation."),
    ("a token", "A token is a piece of text, often a word or part of a word, that the model reads as one unit. English text averages roughly four characters per token."),
    ("a tokenizer", "A tokenizer turns text into token ids and back. Each model must be used with the tokenizer it was trained with."),
    ("the loss", "The loss is a number that measures how wrong the model's predictions are. Training lowers it by adjusting the weights."),
    ("overfitting", "Overfitting is when a model memorizes its training data and does worse on new data. A rising validation loss while training loss falls is the usual sign."),
    ("learning rate warmup", "Warmup raises the learning rate gradually over the first steps. It avoids large, unstable updates while the optimizer statistics are still empty."),
    ("AdamW", "AdamW is the Adam optimizer with decoupled weight decay. It keeps two running averages per parameter, which costs 8 bytes per parameter in fp32."),
    ("quantization", "Quantization stores numbers with fewer bits, such as 8 or 4 bits per weight. It shrinks memory use at a small cost in accuracy."),
    ("sequence length", "The sequence length is the number of tokens the model processes in one example. Activation memory grows with it, so shorter sequences fit smaller GPUs."),
    ("the KV cache", "The KV cache stores the attention keys and values of earlier tokens during generation. It avoids recomputing them but grows with every generated token."),
    ("attention", "Attention lets each token weigh information from other tokens in the sequence. It is the core operation of a transformer."),
    ("an embedding", "An embedding is a vector of numbers that represents a token. The model learns these vectors so that related tokens end up close together."),
    ("a validation set", "A validation set is data held out from training and used only to measure the model. It shows whether the model generalizes instead of memorizing."),
    ("perplexity", "Perplexity is the exponential of the average loss per token. Lower perplexity means the model predicts the text better."),
    ("dropout", "Dropout randomly zeroes some values during training. It discourages the model from relying on any single feature and reduces overfitting."),
    ("weight decay", "Weight decay gently pulls weights toward zero at each step. It acts as a regularizer that helps against overfitting."),
    ("a checkpoint", "A checkpoint is a saved copy of the model and training state at some step. It lets you resume training or pick the best version later."),
    ("VRAM", "VRAM is the memory on a graphics card. The weights, activations and optimizer states of training all have to fit in it."),
    ("a parameter", "A parameter is one learned number in the model, such as a single weight. A 1B model has about one billion of them."),
    ("fine-tuning", "Fine-tuning continues training a pretrained model on a smaller, task-specific dataset. It adapts the model's behaviour without training from scratch."),
    ("an adapter", "An adapter is a small set of extra trainable weights added to a frozen model. Only the adapter is saved, so it takes megabytes instead of gigabytes."),
    ("instruction tuning", "Instruction tuning fine-tunes a model on pairs of instructions and good responses. It teaches the model to follow requests instead of just continuing text."),
    ("response-only loss", "Response-only loss computes the loss on the answer tokens and ignores the prompt tokens. The model learns to answer, not to repeat questions."),
    ("sequence packing", "Packing places several short examples in one sequence of the maximum length. It wastes fewer tokens on padding, so each step trains on more real data."),
    ("padding", "Padding fills shorter sequences with a special token so a batch has one length. The padded positions are masked out of attention and loss."),
    ("the optimizer state", "The optimizer state is the extra data an optimizer keeps per parameter, such as Adam's moving averages. For AdamW in fp32 it is twice the size of the fp32 weights."),
    ("activations", "Activations are the intermediate outputs saved during the forward pass for use in the backward pass. Their memory grows with batch size and sequence length."),
    ("8-bit Adam", "8-bit Adam stores the optimizer states in 8 bits instead of 32. It cuts optimizer memory from 8 to about 2 bytes per parameter."),
    ("CPU offloading", "CPU offloading moves optimizer states or weights from GPU memory to system RAM. It frees GPU memory but slows each step because data crosses the PCIe bus."),
    ("a learning rate schedule", "A learning rate schedule changes the learning rate during training. A common choice is a short warmup followed by a cosine decay."),
    ("gradient clipping", "Gradient clipping scales gradients down when their norm exceeds a limit. It prevents a single bad batch from causing a huge update."),
]
DEF_TEMPLATES = ["What is {t}?", "Define {t}.", "Explain {t} in simple words."]
for i, (term, text) in enumerate(DEFS):
    add(DEF_TEMPLATES[i % 3].format(t=term), text)

# ---------------------------------------------------------------- polite rewrites (hand-written)
POLITE = [
    ("Send me the file.", "Could you please send me the file?"),
    ("Give me the report now.", "Could you please send me the report when you have a moment?"),
    ("Fix this bug today.", "Would you be able to fix this bug today, please?"),
    ("Stop talking during the meeting.", "Could we please keep the discussion for after the meeting?"),
    ("Call me back.", "Could you please call me back when you are free?"),
    ("Move your car.", "Would you mind moving your car, please?"),
    ("Answer my email.", "I would appreciate a reply to my email when you have time."),
    ("Turn the music down.", "Could you please turn the music down a little?"),
    ("Tell me the price.", "Could you please tell me the price?"),
    ("Check my code.", "Would you have time to review my code, please?"),
    ("Be on time tomorrow.", "Could you please try to be on time tomorrow?"),
    ("Explain this again.", "Would you mind explaining this once more, please?"),
    ("Close the door.", "Could you please close the door?"),
    ("Wait here.", "Would you mind waiting here for a moment, please?"),
    ("Don't touch my desk.", "Could you please leave my desk as it is?"),
    ("Finish the slides by Friday.", "Could you please finish the slides by Friday?"),
    ("Update the documentation.", "Would you be able to update the documentation, please?"),
    ("Share the GPU with the team.", "Could you please share the GPU with the rest of the team?"),
    ("Give me feedback on my draft.", "I would be grateful for your feedback on my draft."),
    ("Book the meeting room.", "Could you please book the meeting room for us?"),
    ("Reply faster.", "I would appreciate it if you could reply a little sooner."),
    ("Lower the batch size.", "Could you please try a lower batch size?"),
    ("Bring the charger back.", "Could you please bring the charger back when you are done?"),
    ("Print these pages.", "Would you mind printing these pages for me, please?"),
    ("Speak more slowly.", "Could you please speak a little more slowly?"),
    ("Clean up the shared folder.", "Could you please tidy up the shared folder when you have time?"),
    ("Send the invoice again.", "Could you please send the invoice once more?"),
    ("Restart the server.", "Would you be able to restart the server, please?"),
]
POLITE_INSTR = ["Rewrite the sentence politely.", "Make this request more polite.", "Rephrase this so it sounds courteous."]
for i, (blunt, polite) in enumerate(POLITE):
    add(POLITE_INSTR[i % 3], f"{polite} It asks for the same thing in a courteous way.", blunt)

# ---------------------------------------------------------------- one-sentence summaries (hand-written)
SUMMARIES = [
    ("The meeting that was planned for Monday morning has been moved to Wednesday afternoon because the manager is travelling.",
     "The Monday meeting moves to Wednesday afternoon."),
    ("After testing several settings, the team found that a learning rate of 2e-4 gave the lowest validation loss for the adapter.",
     "A learning rate of 2e-4 worked best."),
    ("Because the GPU ran out of memory at a sequence length of 4096, we reduced it to 2048 and turned on gradient checkpointing.",
     "Memory ran out, so the sequence length was halved and checkpointing enabled."),
    ("The library closes early on public holidays, so visitors should check the website before coming.",
     "Check the website because the library closes early on holidays."),
    ("Heavy rain is expected over the weekend, and the city has advised residents to avoid travelling unless necessary.",
     "Heavy weekend rain is expected, so avoid unnecessary travel."),
    ("The new laptop is lighter than the old one, has a longer battery life, and costs about the same.",
     "The new laptop is lighter and lasts longer for the same price."),
    ("Our customer survey shows that most users want faster loading times more than new features.",
     "Users want faster loading more than new features."),
    ("The training run stopped after six hours because the disk filled up with checkpoints.",
     "Training stopped when checkpoints filled the disk."),
    ("Students who submit the assignment after Friday will lose ten percent of their marks for each late day.",
     "Late assignments lose ten percent per day after Friday."),
    ("The bakery on the corner now opens at seven instead of eight and sells fresh bread until noon.",
     "The bakery opens an hour earlier and sells bread until noon."),
    ("Switching the optimizer to 8-bit AdamW saved about six gigabytes of GPU memory without changing the final loss.",
     "8-bit AdamW saved six gigabytes with no loss change."),
    ("The museum will be closed for renovation from March to June and will reopen with two new galleries.",
     "The museum closes March to June and reopens with new galleries."),
    ("Due to a supplier delay, the order will arrive two weeks later than originally promised.",
     "The order is two weeks late because of a supplier."),
    ("The model answered most questions correctly but often made mistakes with dates and numbers.",
     "The model is mostly right but weak on dates and numbers."),
    ("Employees can now work from home two days a week, as long as their team agrees on which days.",
     "Staff may work from home two agreed days a week."),
    ("The bridge will be closed to cars for repairs next month, but pedestrians and cyclists can still cross.",
     "Next month the bridge closes to cars but not to walkers or cyclists."),
    ("Using LoRA with rank 16 reached nearly the same accuracy as full fine-tuning while training far fewer parameters.",
     "LoRA rank 16 nearly matched full fine-tuning with far fewer parameters."),
    ("The concert sold out within an hour, so the organisers added a second show on Sunday.",
     "A second show was added after the concert sold out."),
    ("Drinking enough water during hot weather helps prevent headaches and tiredness.",
     "Drink water in hot weather to avoid headaches and tiredness."),
    ("The app update fixes the login problem and makes photo uploads about twice as fast.",
     "The update fixes login and doubles upload speed."),
    ("Because the dataset contained many duplicate rows, the validation loss looked better than the model really was.",
     "Duplicate rows made the validation loss look too good."),
    ("The train to the airport runs every fifteen minutes during the day and every hour at night.",
     "Airport trains run every 15 minutes by day and hourly at night."),
    ("Packing short examples into full-length sequences cut the training time by almost half.",
     "Packing nearly halved the training time."),
    ("The park's playground is being rebuilt and will have a water area for children by the summer.",
     "The rebuilt playground gets a water area by summer."),
    ("Our team will hire two new engineers next quarter to help with the growing number of support requests.",
     "Two engineers will be hired next quarter for support."),
    ("Lowering the micro-batch size to one and raising gradient accumulation let the model fit on an 8 GB card.",
     "Smaller micro-batches with accumulation made it fit in 8 GB."),
]
SUM_INSTR = ["Summarize the sentence in a few words.", "Give a short summary of this text.", "Shorten this sentence, keeping the main point."]
for i, (text, summary) in enumerate(SUMMARIES):
    add(SUM_INSTR[i % 3], f"{summary} The details are left out and the main point is kept.", text)

# ---------------------------------------------------------------- check and write
keys = set()
uniq = []
for r in rows:
    k = (r["instruction"], r["input"])
    if k in keys:
        continue
    keys.add(k)
    uniq.append(r)
rng.shuffle(uniq)
print(len(uniq), file=sys.stderr)
with open(sys.argv[1], "w", encoding="utf-8") as f:
    for r in uniq:
        f.write(json.dumps(r, ensure_ascii=False) + "\n")
