"""Spiffy: lossless self-speculation for masked diffusion LMs with calibrated draft graphs.

Agrawal et al. 2025, "Spiffy: Multiplying Diffusion LLM Acceleration via Lossless Speculative Decoding" (arXiv
2509.18085). A diffusion LM decodes a block as a chain of states X(t) -> X(t+1) -> ...; Spiffy guesses several
future states, runs them in the same forward as the real state, and takes every step whose real result equals a
guess for free.

    draft node   a future block state written as a formula: a set of (i, j) pairs, "unmask the still-masked
                 position of confidence rank i with its token of rank j", ranked under the distribution in hand
                 (the one that produced the current state). A child is one step later than its parent.
    graph        D nodes chosen offline from real decoding trajectories (`calibrate`, degree-1 accumulation:
                 count(q) + sum of its parents' counts), saved as JSON (`DraftGraph`).
    pruning      at each forward keep D* nodes per row by score = geometric mean of the node's own probability
                 (geometric mean of its tokens' probabilities) and its children's scores (`propose_drafts`).
    verification one forward carries the real block and D* draft copies; a draft attends to the context and to
                 itself, never to the real block, and its K/V is never cached (`Canvas.forward`).
    acceptance   compute the real next state with the ordinary rule; if a draft equals it, the draft's logits are
                 that state's distribution: apply the rule again and look for the next match (`accept_drafts`),
                 a chain through the graph.

Every emitted token comes from the model's own distribution through the same rule with the same noise, so the
output equals ordinary decoding whenever draft logits equal a separate forward on the draft state: on block-causal
models (SDAR) and with the dual cache (see `DiffusionGenerationConfig.is_exact_for`).
"""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ._hub import check_folder_or_repo_id, check_hub_options, find_file, split_push_options, upload_folder
from ._warnings import warn_at_caller
from .diffusion.decoding import DiffusionGenerationConfig, confidence, without_mask_token

GRAPH_FORMAT_VERSION = 1
GRAPH_FILE = "spiffy_graph.json"
ROOT = -1  # parent id of the nodes one step ahead of the current state

Formula = tuple[tuple[int, int], ...]  # sorted (position rank i, token rank j) pairs
# what `repr(graph)` shows of its calibration: the model and the decoding settings its drafts were learned under
CALIBRATION_SUMMARY = ("model", "cache", "threshold", "steps_per_block", "remasking", "temperature")


# ----------------------------------------------------------------------------------------------------------------
# The graph artifact
# ----------------------------------------------------------------------------------------------------------------


@dataclass
class DraftGraph:
    """D draft nodes in topological order. nodes[n]: the node's formula; parents[n]: ids of its parents (ROOT = -1
    for a node one step ahead of the current state); counts[n]: how often calibration saw it; calibration: the
    decoding settings and data it was calibrated with; block_length: the block length it drafts for, the one it was
    calibrated with (decoding that leaves block_length out uses it)."""

    nodes: list[Formula]
    parents: list[list[int]]
    block_length: int
    counts: list[int] = field(default_factory=list)
    calibration: dict = field(default_factory=dict)

    def __post_init__(self):
        self.nodes = [tuple(sorted((int(i), int(j)) for i, j in pairs)) for pairs in self.nodes]
        self.parents = [sorted(int(p) for p in ps) for ps in self.parents]
        self._validate()
        self._tensors = {}

    def __len__(self) -> int:
        return len(self.nodes)

    @property
    def max_token_rank(self) -> int:
        return max(j for pairs in self.nodes for _, j in pairs)

    def _validate(self) -> None:
        def bad(message):
            return ValueError(f"Invalid Spiffy draft graph: {message}. Recalibrate it with `hf-specdiff calibrate`.")

        if isinstance(self.block_length, bool) or not isinstance(self.block_length, int) or self.block_length < 1:
            raise bad(f"block_length must be a positive integer, got {self.block_length!r}")
        if not self.nodes:  # before: "0 nodes but 0 parent lists", which reads as a count mismatch
            raise bad("it has no nodes, and Spiffy drafts from at least one")
        if len(self.parents) != len(self.nodes):
            raise bad(f"{len(self.nodes)} nodes but {len(self.parents)} parent lists")
        if self.counts and len(self.counts) != len(self.nodes):
            raise bad(f"{len(self.nodes)} nodes but {len(self.counts)} counts")
        if wrong := [c for c in self.counts if isinstance(c, bool) or not isinstance(c, int) or c < 0]:
            raise bad(f"counts must be integers >= 0, got {wrong[:3]}")
        for n, (pairs, parents) in enumerate(zip(self.nodes, self.parents)):
            positions = [i for i, _ in pairs]
            if not pairs or len(set(positions)) != len(positions):
                raise bad(f"node {n} must unmask at least one position, each position once: {pairs}")
            if any(i < 0 or i >= self.block_length or j < 0 for i, j in pairs):
                raise bad(f"node {n} has a position rank outside [0, {self.block_length}) or a negative token rank")
            if not parents:
                raise bad(f"node {n} has no parent (use {ROOT} for the current state)")
            if len(set(parents)) != len(parents):
                raise bad(f"node {n} names a parent twice: {parents}")
            for p in parents:
                if p != ROOT and not 0 <= p < n:
                    raise bad(f"node {n} names parent {p}; parents must come earlier in the list")
                if p != ROOT and not set(self.nodes[p]) < set(pairs):
                    raise bad(f"node {n} does not extend its parent {p}")

    # -- save / load --------------------------------------------------------------------------------------------

    def to_dict(self) -> dict:
        nodes = [{"pairs": [list(p) for p in pairs], "parents": parents}
                 | ({"count": self.counts[n]} if self.counts else {})
                 for n, (pairs, parents) in enumerate(zip(self.nodes, self.parents))]
        return {"format_version": GRAPH_FORMAT_VERSION, "block_length": self.block_length,
                "calibration": self.calibration, "nodes": nodes}

    @classmethod
    def from_dict(cls, data: dict) -> DraftGraph:
        if not isinstance(data, dict):
            raise ValueError(f"A Spiffy graph is a JSON object, got a {type(data).__name__}: the file is corrupt; "
                             "recalibrate the graph.")
        version = data.get("format_version")
        if version != GRAPH_FORMAT_VERSION:
            raise ValueError(
                f"Spiffy graph format_version {version!r} is not supported (this hf_specdiff reads "
                f"{GRAPH_FORMAT_VERSION}); upgrade hf_specdiff or recalibrate the graph."
            )
        def whole(value):  # JSON integers only: a float or a string would be truncated or parsed, true taken for 1
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"{value!r} is not an integer")
            return value

        try:  # parsing; what the fields mean is checked when the graph is built
            nodes = data["nodes"]
            fields = dict(nodes=[[(whole(i), whole(j)) for i, j in n["pairs"]] for n in nodes],
                          parents=[[whole(p) for p in n["parents"]] for n in nodes],
                          counts=[whole(n["count"]) for n in nodes] if all("count" in n for n in nodes) else [],
                          block_length=whole(data["block_length"]), calibration=data.get("calibration", {}))
        except (KeyError, TypeError, ValueError) as error:  # a missing field, a pair that is not (int, int), ...
            raise ValueError(f"Spiffy graph JSON is malformed ({type(error).__name__}: {error}); recalibrate it.") \
                from error
        return cls(**fields)

    def save_pretrained(self, folder: str | Path) -> Path:
        path = Path(folder) / GRAPH_FILE
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_dict(), indent=1) + "\n")
        return path

    @classmethod
    def from_pretrained(cls, path_or_repo_id: str | Path, **hub_kwargs) -> DraftGraph:
        """Load from a folder holding spiffy_graph.json, the file itself, or a Hub repo id (`hub_kwargs`: transformers'
        download options, `revision`, `subfolder`, `cache_dir`, ...)."""
        check_hub_options(hub_kwargs, "Spiffy draft graph")
        path = Path(path_or_repo_id)
        if path.is_file():
            if hub_kwargs:
                raise TypeError(f"{path} is a file: the Hub options {sorted(hub_kwargs)} do not apply; drop them.")
            file = path
        else:
            check_folder_or_repo_id(path_or_repo_id, "draft graph")
            file = find_file(str(path_or_repo_id), GRAPH_FILE, "draft graph", "Calibrate one for its diffusion "
                             "LM (`hf-specdiff calibrate --model MODEL --output FOLDER`), or point at the folder "
                             "holding it.", **hub_kwargs)
        try:
            data = json.loads(Path(file).read_text())
        except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as error:  # the last: nested past Python's
            raise ValueError(f"{file} is not valid JSON ({error}); recalibrate the graph.") from error  # stack
        return cls.from_dict(data)

    def push_to_hub(self, repo_id: str, commit_message: str = "Upload Spiffy draft graph", **kwargs):
        """Upload spiffy_graph.json as one commit (transformers' commit options: `commit_description`, `private`,
        `token`, `revision`, `create_pr`), creating the repo if need be. Returns the commit info."""
        import tempfile

        upload, _ = split_push_options(kwargs, (), "Spiffy draft graph")
        with tempfile.TemporaryDirectory() as folder:
            self.save_pretrained(folder)
            return upload_folder(Path(folder), repo_id, commit_message, **upload)

    def check_block_length(self, config: DiffusionGenerationConfig) -> None:
        """Refuse decoding in blocks of another length than the graph's: its formulas rank positions of one block
        of that length (block_length None, left out, is the graph's)."""
        if config.block_length is not None and config.block_length != self.block_length:
            raise ValueError(
                f"This Spiffy graph was calibrated for block_length={self.block_length}, but decoding uses "
                f"block_length={config.block_length}. Leave block_length out to decode in the graph's blocks, or pass "
                f"block_length={self.block_length} (on the command line: --block-length {self.block_length}, or no "
                f"--block-length), or calibrate a graph for {config.block_length} "
                f"(`hf-specdiff calibrate --block-length {config.block_length}`)."
            )

    def check_compatible(self, config: DiffusionGenerationConfig, vocab_size: int | None = None, model=None) -> None:
        """Refuse decoding the graph cannot draft for (another block length, a smaller vocabulary); warn where its
        recorded calibration settings differ from `config`'s (`calibration_differences`, of `model` where given).
        block_length None (left out) is the graph's."""
        if vocab_size is not None and self.max_token_rank >= vocab_size:
            raise ValueError(f"This Spiffy graph uses token rank {self.max_token_rank}, but the model has {vocab_size} "
                             "tokens: it was calibrated for another model; recalibrate it for this one.")
        self.check_block_length(config)
        if differences := self.calibration_differences(config, model):
            # Spiffy takes a draft only where it equals the real next state, so a graph learned under other settings
            # costs accepted drafts (forwards saved), never correctness: a warning, not a refusal
            warn_at_caller(
                f"This Spiffy graph was calibrated with other decoding settings ({', '.join(differences)}): its drafts "
                "follow trajectories of that decoding, so fewer of them may be accepted here (Spiffy stays as lossless "
                "as with a matching graph). For more forwards saved, calibrate a graph with these settings "
                "(`hf-specdiff calibrate` with the same --cache, --threshold, --steps, --remasking and --temperature)."
            )

    def calibration_differences(self, config: DiffusionGenerationConfig, model=None) -> list[str]:
        """The decoding settings the graph recorded at calibration that `config` does not share, as "name: recorded
        value (graph) vs value (now)"; settings it did not record (a graph built by hand) are not compared, nor, for
        a block-causal `model`, the cache: every cache mode decodes it exactly, so along the same trajectories.
        block_length None (left out) is the graph's."""
        config = config.for_model(model, self)
        now = {"cache": config.cache, "threshold": config.threshold, "steps_per_block": config.steps_per_block,
               "remasking": config.remasking, "temperature": config.temperature}
        if getattr(model, "block_causal", False):
            del now["cache"]
        return [f"{name}: {self.calibration[name]!r} (graph) vs {value!r} (now)" for name, value in now.items()
                if name in self.calibration and self.calibration[name] != value]

    def __repr__(self) -> str:  # the dataclass's would print every node
        settings = {name: self.calibration[name] for name in CALIBRATION_SUMMARY if name in self.calibration}
        shown = "".join(f", {name}={value!r}" for name, value in settings.items())
        return f"DraftGraph({len(self)} nodes, depth {self.depth}, block_length={self.block_length}{shown})"

    @property
    def depth(self) -> int:
        """Steps ahead of the current state that the deepest node lies (a node one step ahead has depth 1)."""
        depth = []
        for parents in self.parents:  # topological order: a node's parents come before it
            depth.append(1 + max((0 if p == ROOT else depth[p] for p in parents), default=0))
        return max(depth, default=0)

    # -- index tensors for vectorised drafting ------------------------------------------------------------------

    def tensors(self, device) -> dict:
        if device not in self._tensors:
            pair_node = [n for n, pairs in enumerate(self.nodes) for _ in pairs]
            d = len(self.nodes)
            children = torch.zeros(d, d, dtype=torch.bool)
            for n, parents in enumerate(self.parents):
                for p in parents:
                    if p != ROOT:
                        children[p, n] = True
            height = [0] * d  # longest path down to a leaf: a node's children all have a smaller height
            for n in reversed(range(d)):
                height[n] = 1 + max((height[c] for c in children[n].nonzero()[:, 0].tolist()), default=-1)
            self._tensors[device] = {
                "levels": [torch.tensor([n for n in range(d) if height[n] == h], device=device)
                           for h in range(max(height) + 1)],
                "pair_node": torch.tensor(pair_node, device=device),
                "pair_i": torch.tensor([i for pairs in self.nodes for i, _ in pairs], device=device),
                "pair_j": torch.tensor([j for pairs in self.nodes for _, j in pairs], device=device),
                "pairs_per_node": torch.tensor([len(p) for p in self.nodes], device=device),
                "children": children.to(device),  # [p, n]: n is a child of p
                "from_root": torch.tensor([ROOT in ps for ps in self.parents], device=device),
            }
        return self._tensors[device]


# ----------------------------------------------------------------------------------------------------------------
# Drafting with dynamic pruning, and acceptance
# ----------------------------------------------------------------------------------------------------------------


def formula_frame(state, in_hand, mask_token_id, remasking, num_token_ranks):
    """The frame formulas are read in: masked positions of `state` ranked by confidence under the distribution in
    hand, and each position's top tokens. Returns (position by rank (b, L), number masked (b,), top token ids and
    probabilities (b, L, J))."""
    masked = state == mask_token_id
    in_hand = without_mask_token(in_hand, mask_token_id)
    _, score = confidence(in_hand, "low_confidence" if remasking == "random" else remasking)
    order = score.masked_fill(~masked, -torch.inf).argsort(dim=-1, descending=True, stable=True)
    top = in_hand.softmax(dim=-1).topk(num_token_ranks, dim=-1)
    return order, masked.sum(dim=-1), top.indices, top.values


@dataclass
class Drafts:
    tokens: torch.LongTensor  # (b, D*, L) draft block states
    nodes: torch.LongTensor  # (b, D*) graph node of each draft
    valid: torch.BoolTensor  # (b, D*) False where a row had fewer than D* usable nodes


def propose_drafts(graph: DraftGraph, state, in_hand, mask_token_id: int, config: DiffusionGenerationConfig) -> Drafts:
    """Materialise the graph's formulas for each row, score them, and keep D* = config.max_drafts connected nodes."""
    g = graph.tensors(state.device)
    b, block_length = state.shape
    order, num_masked, top_tokens, top_probs = formula_frame(
        state, in_hand, mask_token_id, config.remasking, graph.max_token_rank + 1
    )
    # 1. Fill in every node: pair (i, j) -> (position order[i], its token of rank j).
    position = order[:, g["pair_i"]]  # (b, P)
    token = top_tokens[torch.arange(b)[:, None], position, g["pair_j"][None]]
    log_prob = top_probs[torch.arange(b)[:, None], position, g["pair_j"][None]].clamp_min(1e-300).log()
    usable_pair = g["pair_i"][None] < num_masked[:, None]
    d = len(graph)
    node_usable = torch.zeros(b, d, device=state.device).index_add_(1, g["pair_node"], (~usable_pair).float()) == 0
    states = state[:, None].repeat(1, d, 1)
    states.view(b, -1).scatter_(1, g["pair_node"][None] * block_length + position, token.to(states.dtype))

    # 2. Score: geometric mean of the node's own token probabilities and of its usable children's scores.
    local = torch.zeros(b, d, device=state.device, dtype=torch.float64).index_add_(1, g["pair_node"], log_prob)
    local = local / g["pairs_per_node"]
    score = torch.zeros_like(local)
    for level in g["levels"]:  # leaves first; a level's children are all scored already
        kids = node_usable[:, None, :] & g["children"][level][None]  # (b, |level|, d)
        total = local[:, level] + (kids * score[:, None, :]).sum(dim=-1)
        score[:, level] = total / (1 + kids.sum(dim=-1))
    score = score.masked_fill(~node_usable, -torch.inf)

    # 3. Prune to D* nodes that stay connected to the current state, best score first.
    available = g["from_root"][None] & node_usable
    chosen = torch.zeros(b, d, dtype=torch.bool, device=state.device)
    keep = min(config.max_drafts, d)
    nodes = torch.zeros(b, keep, dtype=torch.long, device=state.device)
    valid = torch.zeros(b, keep, dtype=torch.bool, device=state.device)
    for k in range(keep):
        candidates = torch.where(available & ~chosen, score, -torch.inf)
        best = candidates.argmax(dim=-1)
        valid[:, k] = candidates.max(dim=-1).values > -torch.inf
        nodes[:, k] = best
        chosen[torch.arange(b), best] |= valid[:, k]
        available |= g["children"][best] & node_usable & valid[:, k, None]
    tokens = states.gather(1, nodes[..., None].expand(-1, -1, block_length))
    return Drafts(tokens=torch.where(valid[..., None], tokens, state[:, None]), nodes=nodes, valid=valid)


def accept_drafts(unmask, state, logits, step, drafts: Drafts, draft_logits, mask_token_id: int):
    """Take the real step, then every further step whose state a draft already computed.

    Each new state is compared with every kept draft not used yet, not only with the children of the last accepted
    node as in the paper's walk: a draft equal to the real state is that state wherever it sits in the graph, so
    this accepts at least as much, and stays lossless, for the cost of one batched comparison.

    Returns (new state (b, L), the distribution in hand for it (b, L, V), step (b,), drafts accepted (b,))."""
    b = state.shape[0]
    rows = torch.arange(b, device=state.device)
    unused = drafts.valid.clone()
    accepted = torch.zeros(b, dtype=torch.long, device=state.device)
    active = torch.ones(b, dtype=torch.bool, device=state.device)
    while True:
        # The ordinary rule on the state whose distribution is in hand (exactly what decoding without drafts does).
        advance = active & (state == mask_token_id).any(dim=-1)
        state = torch.where(advance[:, None], unmask(state, logits, step), state)
        step = step + advance
        # A draft equal to the new state (with masks left to decode) has computed that state's distribution.
        match = (drafts.tokens == state[:, None]).all(dim=-1) & unused & advance[:, None]
        match &= (state == mask_token_id).any(dim=-1)[:, None]
        found = match.any(dim=-1)
        if not bool(found.any()):
            return state, logits, step, accepted
        pick = match.int().argmax(dim=-1)
        logits = torch.where(found[:, None, None], draft_logits[rows, pick], logits)
        unused[rows, pick] &= ~found
        accepted += found
        active = found


# ----------------------------------------------------------------------------------------------------------------
# Calibration
# ----------------------------------------------------------------------------------------------------------------


class TrajectoryRecorder:
    """Records ordinary decoding (as `diffusion_generate(recorder=...)`) and counts the future states it reached,
    as formulas in the frame of each intermediate state. Nodes deeper than `max_depth` steps or using a token
    rank >= `num_token_ranks` are not counted (the path stops there)."""

    def __init__(self, mask_token_id: int, remasking: str, max_depth: int = 6, num_token_ranks: int = 3):
        self.mask_token_id, self.remasking = mask_token_id, remasking
        self.max_depth, self.num_token_ranks = max_depth, num_token_ranks
        self.counts: Counter[Formula] = Counter()
        self.edges: Counter[tuple[Formula | None, Formula]] = Counter()  # (parent or None for the root, child)
        self._trajectory = defaultdict(list)  # row -> [(state, frame)] within the current block

    def __call__(self, block, step, before, logits, after):
        order, num_masked, top_tokens, _ = formula_frame(after, logits, self.mask_token_id, self.remasking,
                                                         self.num_token_ranks)
        for row in range(after.shape[0]):
            if not bool((before[row] == self.mask_token_id).any()):
                continue
            self._trajectory[row].append((after[row].cpu(), order[row].cpu(), top_tokens[row].cpu()))
            if not bool((after[row] == self.mask_token_id).any()):
                self._count(self._trajectory.pop(row))

    def _count(self, trajectory) -> None:
        for t, (root, order, top_tokens) in enumerate(trajectory):
            rank_of_position = order.argsort()
            masked = root == self.mask_token_id
            parent = None
            for future, _, _ in trajectory[t + 1 : t + 1 + self.max_depth]:
                pairs = []
                for position in (masked & (future != self.mask_token_id)).nonzero()[:, 0].tolist():
                    hits = (top_tokens[position] == future[position]).nonzero()
                    if not len(hits):
                        break
                    pairs.append((int(rank_of_position[position]), int(hits[0, 0])))
                else:
                    if not pairs:  # no position unmasked in this step: nothing to draft
                        break
                    node = tuple(sorted(pairs))
                    self.counts[node] += 1
                    self.edges[(parent, node)] += 1
                    parent = node
                    continue
                break

    def select(self, num_nodes: int) -> tuple[list[Formula], list[list[int]], list[int]]:
        """Choose `num_nodes` nodes forming a connected graph below the root, by degree-1 accumulation:
        value(q) = count(q) + sum over its parents p of count(p)."""
        parents, children = defaultdict(set), defaultdict(set)
        for parent, child in self.edges:
            parents[child].add(parent)
            children[parent].add(child)
        value = {q: self.counts[q] + sum(self.counts[p] for p in parents[q] if p is not None) for q in self.counts}
        chosen, frontier = [], set(children[None])
        while frontier and len(chosen) < num_nodes:
            best = max(frontier, key=lambda q: (value[q], -len(q), q))
            frontier.remove(best)
            chosen.append(best)
            frontier |= children[best] - set(chosen)
        chosen.sort(key=lambda q: (len(q), q))  # a child unmasks more positions than its parents: topological
        index = {q: n for n, q in enumerate(chosen)}
        graph_parents = [sorted(ROOT if p is None else index[p] for p in parents[q] if p is None or p in index)
                         for q in chosen]
        return chosen, graph_parents, [self.counts[q] for q in chosen]


def check_calibration_options(num_nodes: int, max_depth: int, num_token_ranks: int, vocab_size: int | None = None):
    """Before any decoding: a graph needs nodes, nodes lie at least one step ahead, and a token rank is a token."""
    for name, value in (("num_nodes", num_nodes), ("max_depth", max_depth), ("num_token_ranks", num_token_ranks)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {value!r}.")
    if vocab_size is not None and num_token_ranks > vocab_size:
        raise ValueError(f"num_token_ranks={num_token_ranks} exceeds the model's vocabulary ({vocab_size} tokens).")


def calibrate(model, prompts: list[torch.LongTensor], config: DiffusionGenerationConfig, num_nodes: int = 64,
              max_depth: int = 6, num_token_ranks: int = 3, progress: bool = True, description: dict | None = None):
    """Calibrate a `DraftGraph` for `model` under decoding `config` from ordinary decoding of `prompts` (token id
    tensors of shape (1, n) or (n,)); config.block_length None (left out) is the model's own (`for_model`), and the
    graph drafts for that block length only. The paper uses about 25 MATH-500 + 25 MBPP prompts."""
    from tqdm.auto import tqdm

    from .diffusion.decoding import diffusion_generate

    check_calibration_options(num_nodes, max_depth, num_token_ranks, getattr(model.config, "vocab_size", None))
    config = config.for_model(model)
    config.validate(model)
    recorder = TrajectoryRecorder(model.mask_token_id, config.remasking, max_depth, num_token_ranks)
    device = next(model.parameters()).device
    for prompt in tqdm(prompts, desc="calibrate", disable=not progress):
        if prompt.dim() > 2 or (prompt.dim() == 2 and prompt.shape[0] != 1):
            raise ValueError(f"calibrate takes one prompt per tensor, (1, n) or (n,); got {tuple(prompt.shape)}: pass "
                             "the rows of a batch as separate prompts, without their padding.")
        ids = prompt.reshape(1, -1).to(device)
        diffusion_generate(model, ids, config=config, recorder=recorder)
    if not recorder.counts:
        raise ValueError("Calibration recorded no trajectory: give prompts and a config with more than one step per "
                         "block, or a larger num_token_ranks.")
    nodes, parents, counts = recorder.select(num_nodes)
    settings = {"remasking": config.remasking, "threshold": config.threshold, "temperature": config.temperature,
                "steps_per_block": config.steps_per_block, "cache": config.cache, "prompts": len(prompts),
                "max_depth": max_depth, "num_token_ranks": num_token_ranks} | (description or {})
    return DraftGraph(nodes=nodes, parents=parents, counts=counts, block_length=config.block_length,
                      calibration=settings)
