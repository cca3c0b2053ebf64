"""Bounded-depth suffix trees with counts, for the `suffix` speculator (suffix decoding, arXiv 2411.04975).

A tree holds every substring of at most `depth` tokens of what was inserted, one node per
substring, with `count` = how many times it occurs (as Arctic Inference's SuffixTree counts "the
suffixes that pass through a node"). A node's most frequent child continues its substring the way
it was most often continued, with estimated probability count[child] / count[node].

Tokens go in one at a time against a *frontier*: the nodes of the suffixes (lengths 1..depth-1)
of what was inserted so far. Appending a token moves each frontier node to its child for that
token (made when missing, count + 1), so a token costs O(depth) whatever the history's length.
`follow` does the same with lookups only: it tracks where a history stands in a tree it is not
inserted into (the global tree). `unwind` takes the positions >= p0 of an inserted history out
again (an output evicted from the global tree, a rollback of a per-request tree).

Layout: nodes are ints indexing parallel lists of ints, and children of a node with two or more
(and of the root) are found in one dict keyed by node << 32 | token. Nothing per node is an object
the garbage collector tracks: with a node per object, a global tree of a million nodes cost a
~300 ms full collection every few dozen finished requests. No path compression (Arctic's C++ tree
merges single-child chains), so a node costs ~70-100 bytes and there are up to `depth` per token.
"""
from __future__ import annotations

from collections import deque
from typing import Sequence

ROOT = 0
NONE = -1  # no node
STALE = -2  # best[n] while n's most frequent child is to be found again (its best lost counts)


class SuffixTree:
    """Every substring of at most `depth` tokens of the inserted sequences, counted.

    Per node n: count[n]; tok[n], the token on the edge into n; best[n], the child with the
    highest count (ties: the one that reached it last), NONE without children, STALE to be
    found again; first[n] and next[c], the children as a linked list (most recent first).
    """

    def __init__(self, depth: int):
        assert depth >= 2, f"a suffix tree needs depth >= 2 to propose anything, got {depth}"
        self.depth = depth
        self.count, self.tok, self.best, self.first, self.next = [0], [NONE], [NONE], [NONE], [NONE]
        # node << 32 | token -> child, for every child of the root (whose key is the token) and of
        # nodes with two children or more; a node's only child is first[node]
        self.edges: dict[int, int] = {}
        self._free: list[int] = []  # ids of dropped nodes, reused
        self.n_nodes = 0  # nodes below the root

    # --- structure ----------------------------------------------------------------------------

    def _add_child(self, n: int, t: int) -> int:
        """A new child of n for token t, with count 1."""
        if self._free:
            c = self._free.pop()
            self.count[c], self.tok[c], self.best[c], self.first[c], self.next[c] = 1, t, NONE, NONE, NONE
        else:
            c = len(self.count)
            self.count.append(1)
            self.tok.append(t)
            self.best.append(NONE)
            self.first.append(NONE)
            self.next.append(NONE)
        self.n_nodes += 1
        if n == ROOT:
            self.edges[t] = c
            return c
        f = self.first[n]
        if f != NONE:
            if self.next[f] == NONE:  # a second child: the children go into `edges`
                self.edges[n << 32 | self.tok[f]] = f
            self.edges[n << 32 | t] = c
        self.next[c], self.first[n] = f, c
        b = self.best[n]
        if b == NONE or (b >= 0 and self.count[b] <= 1):
            self.best[n] = c
        return c

    def _child(self, n: int, t: int) -> int:
        """Child t of n, or NONE."""
        if n == ROOT:
            return self.edges.get(t, NONE)
        c = self.best[n]
        if c >= 0 and self.tok[c] == t:
            return c
        f = self.first[n]
        if f == NONE:
            return NONE
        if self.next[f] != NONE:
            return self.edges.get(n << 32 | t, NONE)
        return f if self.tok[f] == t else NONE

    def _bump(self, n: int, t: int) -> int:
        """Child t of n (not the root) with its count raised by one, made if missing. The fast case,
        t being n's best child, is inlined by `extend`."""
        c = self._child(n, t)
        if c == NONE:
            return self._add_child(n, t)
        count = self.count
        count[c] += 1
        b = self.best[n]
        if b >= 0 and count[c] >= count[b]:
            self.best[n] = c
        return c

    def _refresh(self, n: int) -> int:
        """Find n's most frequent child again; returns it."""
        count, nxt = self.count, self.next
        c = b = self.first[n]
        while c != NONE:
            if count[c] > count[b]:
                b = c
            c = nxt[c]
        self.best[n] = b
        return b

    def _drop(self, n: int, t: int, c: int) -> None:
        """Unlink child c (token t, count now 0) from n and free it with its chain: a node counted
        once has at most one child, counted once too."""
        first, nxt, edges = self.first, self.next, self.edges
        if n == ROOT:
            del edges[t]
        else:
            if first[n] == c:
                first[n] = nxt[c]
            else:
                p = first[n]
                while nxt[p] != c:
                    p = nxt[p]
                nxt[p] = nxt[c]
            edges.pop(n << 32 | t, None)
            f = first[n]
            if f == NONE:
                self.best[n] = NONE
            elif nxt[f] == NONE:  # one child left: out of `edges`, and the best
                edges.pop(n << 32 | self.tok[f], None)
                self.best[n] = f
            elif self.best[n] == c:
                self.best[n] = STALE
        while c != NONE:
            self._free.append(c)
            self.n_nodes -= 1
            c = first[c]

    # --- insertion, lookup, removal -----------------------------------------------------------

    def extend(self, front: list[int], tokens: Sequence[int]) -> list[int]:
        """Insert `tokens` after the sequence whose frontier is `front` (start: []); the new frontier."""
        count, tok, best, edges = self.count, self.tok, self.best, self.edges
        keep = self.depth - 1
        for t in tokens:
            count[ROOT] += 1
            c = edges.get(t, NONE)
            if c == NONE:
                c = self._add_child(ROOT, t)
            else:
                count[c] += 1
            new = [c]
            for n in front:
                c = best[n]
                if c >= 0 and tok[c] == t:
                    count[c] += 1
                else:
                    c = self._bump(n, t)
                new.append(c)
            if len(new) > keep:  # the node at full depth is counted but never extended
                new.pop()
            front = new
        return front

    def follow(self, front: list[int], tokens: Sequence[int]) -> list[int]:
        """The frontier after `tokens` (lookups only): the nodes, shortest first, of the suffixes of
        length < depth that the tree holds. They are a prefix of all lengths: a substring's suffixes
        are substrings too."""
        tok, best, first, nxt, edges = self.tok, self.best, self.first, self.next, self.edges
        keep = self.depth - 1
        for t in tokens:
            c = edges.get(t, NONE)
            if c == NONE:
                front = []
                continue
            new = [c]
            for n in front:
                c = best[n]
                if c < 0 or tok[c] != t:
                    f = first[n]
                    if f == NONE:
                        break
                    if nxt[f] != NONE:
                        c = edges.get(n << 32 | t, NONE)
                        if c == NONE:
                            break
                    elif tok[f] == t:
                        c = f
                    else:
                        break
                new.append(c)
            if len(new) > keep:
                new.pop()
            front = new
        return front

    def frontier(self, tokens: Sequence[int]) -> list[int]:
        """The frontier of a history that ends with `tokens`, found from scratch: O(depth^2)."""
        return self.follow([], tokens[max(0, len(tokens) - (self.depth - 1)):])

    def unwind(self, tokens: Sequence[int], p0: int = 0) -> None:
        """Take out what positions >= p0 of `tokens` (inserted as one sequence) put in: the
        substrings ending at those positions. Nodes left with count 0 are freed with what hangs
        below them. O((len - p0 + depth) * depth)."""
        count, first, nxt = self.count, self.first, self.next
        depth, n_tok = self.depth, len(tokens)
        for a in range(max(0, p0 - depth + 1), n_tok):
            skip = p0 - a  # the chain of substrings starting at a covers positions >= p0 below depth `skip`
            if skip <= 0:
                count[ROOT] -= 1
            n = ROOT
            for k in range(min(depth, n_tok - a)):
                t = tokens[a + k]
                c = self._child(n, t)
                assert c >= 0, f"suffix tree: unwinding a substring it does not hold (token {t} at {a + k})"
                if k < skip:
                    n = c
                    continue
                count[c] -= 1
                if count[c] == 0:
                    self._drop(n, t, c)
                    break
                if self.best[n] == c and nxt[first[n]] != NONE:
                    self.best[n] = STALE  # another child may now count more
                n = c

    # --- drafting -----------------------------------------------------------------------------

    def propose(self, front: list[int], limit: int, factor: float, offset: float,
                floor: Sequence[float], best: float = 0.0) -> tuple[float, tuple[list[int], list[float]] | None]:
        """The best greedy continuation from any suffix on `front`, as Arctic's `speculate`.

        For each match length d (longest first) whose node has children: follow the most frequent
        child for up to min(limit, int(d * factor + offset)) tokens while the cumulative probability
        (product of count[child] / count[parent]) of token i stays >= floor[i]. A path's score is the
        sum of its cumulative probabilities (its expected accepted tokens); the first path with the
        highest score wins, and only one scoring above `best`. Returns (score, (tokens, conditional
        probabilities)) of the winner, or (best, None) when none beats `best`. A path is abandoned
        as soon as it cannot beat the best so far.
        """
        count, tok, bests, first = self.count, self.tok, self.best, self.first
        depth = self.depth
        d = len(front)
        while d and first[front[d - 1]] == NONE:  # those with children are a prefix of all lengths
            d -= 1
        found = None
        for d in range(d, 0, -1):
            cap = min(limit, int(d * factor + offset + 1e-6), depth - d)
            if cap <= best:
                continue
            n = front[d - 1]
            score, p = 0.0, 1.0
            ids: list[int] = []
            probs: list[float] = []
            for i in range(cap):
                c = bests[n]
                if c < 0:
                    if first[n] == NONE:
                        break
                    c = self._refresh(n)
                q = count[c] / count[n]
                p *= q
                # abandon the path once even all-p tokens after this one cannot beat the best (the
                # margin leaves float near-ties to the exact comparison below)
                if p < floor[i] or score + p * (cap - i) < best - 1e-9:
                    break
                ids.append(tok[c])
                probs.append(q)
                score += p
                n = c
            if score > best:
                best, found = score, (ids, probs)
        return best, found


class GlobalTree:
    """The outputs of finished requests in one SuffixTree, the oldest evicted first (FIFO, as Arctic)
    beyond `max_requests` outputs or `max_tokens` tokens. `version` changes with every change, so
    frontiers found in the tree know when to be found again."""

    def __init__(self, depth: int, max_requests: int, max_tokens: int):
        self.tree = SuffixTree(depth)
        self.max_requests, self.max_tokens = max_requests, max_tokens
        self.outputs: deque[list[int]] = deque()
        self.n_tokens = 0
        self.version = 0

    def add(self, output: Sequence[int]) -> None:
        """Insert one finished output (its first `max_tokens` tokens), evicting the oldest to make room."""
        if self.max_requests <= 0 or not output:
            return
        doc = list(output[:self.max_tokens])
        while self.outputs and (len(self.outputs) >= self.max_requests
                                or self.n_tokens + len(doc) > self.max_tokens):
            old = self.outputs.popleft()
            self.tree.unwind(old)
            self.n_tokens -= len(old)
        self.tree.extend([], doc)
        self.outputs.append(doc)
        self.n_tokens += len(doc)
        self.version += 1
