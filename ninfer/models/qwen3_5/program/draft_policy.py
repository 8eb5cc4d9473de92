"""How many tokens a unit drafts (the MTP head or a DFlash drafter): adaptive k (issues 25, 30).

Speculation is exact whatever k is (program/speculative.py), so k is purely a speed choice, and
the right one depends on things only a running Engine knows: how often this model's drafts are
accepted on this traffic, and what a draft and a verify of k + 1 positions cost on this device at
this batch size. On the numpy backend a verify of k + 1 rows costs about k + 1 decode steps (the
lm_head product grows with the rows), so no k pays; on a GPU a verify reads the weights once for
all positions and k = 3 pays at the reference models' acceptance. A fixed k loses in one case or
the other; this policy measures both and picks, per unit, the k in 0..max_k with the most tokens
per second:

    score(B, k) = E(k) / T(B, k)
    E(k)        = 1 + sum_{j=1..k} P(drafts 1..j all accepted)      tokens a verify row emits
    T(B, k)     = the measured seconds of a unit of B rows drafting k, from the commit before
                  it to its own (draft, verify, commit's State select and drafter feed, and the
                  host's work between units), a running mean per (B, k) in which one unit
                  moves the mean by at most a quarter; T(B, 0) from plain steps launched ahead
                  of the one before, as plain decoding runs, once there is one

k = 0 is plain decoding (E = 1), so the policy never picks a k its own measurements say is
slower than not speculating. P(drafts 1..j accepted) = prod_{i<=j} c_i, c_i the acceptance of
draft i given drafts 1..i-1 were: decayed counts over the verify rows (recent traffic weighs
most), with a prior of one accept in two tries so an untried position is neither hopeless nor
certain. Acceptance is a property of the request as much as of the model (code drafts far better
than free prose; a row whose output left the drafter's reach accepts nothing): where the unit's
rows are named, E(k) is the mean of each row's own, from its own decayed counts (ROW_DECAY: its
last ~10 verifies) shrunk toward the traffic's c_i by ROW_PRIOR_TRIES tries, so rows that stopped
accepting run plainly while the others still draft (bench_speculative --batch 8: two rows past the
drafter's reach, left alone at the end of a round, drafted k = 4 for 81 units at 1.6x a plain
step's cost on the traffic's acceptance). B is exact up to 8, else bucketed by powers of two. At
start every k is measured once, k = 0 up (_cold_start_k: a k that costs as many plain steps as
a verify row can emit at any k ends it, no deeper k could pay: max_k + 1, or less once the first
drafts' acceptance is known), at the first B that runs COLD_START_STREAK units in a row (before
that, plain decoding) (the Speculator takes a unit's time less the one-off work done in it,
Model.one_off_seconds: a graph captured, the GEMM plans of a catch-up feed of a new length; and
less its catch-up feed before the drafts, which the measuring account pays: observe_unit);
after that a new B takes the nearest measured B's choice and estimates the costs it has not
measured from the ratios there, and every EXPLORE_EVERY units at a B the policy runs a neighbour of
its best k once (k = 0: EXPLORE_PLAIN_UNITS units in a row), so costs and the acceptance of deeper
drafts stay current (the wait doubles, up to EXPLORE_MAX, while the best k stays the same, and is
at least what keeps the neighbour's loss within EXPLORE_BUDGET of the time; after the best changed,
the first exploration is EXPLORE_AFTER_CHANGE units away, toward the old best). Measuring has one
account over every B: an exploration runs only while what the cold starts' and explorations'
units lost against the best k (priced with the costs and acceptance known now) and what this one
would lose stay within EXPLORE_BUDGET of all the timed units' time, so a short run does not pay
for a cold start and explorations on top of it (the 9B's never-right head at B = 8 on an H100:
cold starts at B = 1, 2 and 8 and three explorations over 200 tokens, 0.96x). A unit with other
rows beside its drafting ones (a prefill, a Replay) is not timed and runs the best k known, never a
cold start's or an exploration's. "fixed" always drafts max_k (benchmarks, tests of the
mechanism).
"""
from __future__ import annotations

import numpy as np

EXPLORE_EVERY = 32      # units at one B between two runs of a neighbour of the best k, ...
EXPLORE_MAX = 256       # ... doubling up to this while the best k stays the same
# ... and at least until a unit at the neighbour loses at most this share of the units since
# the last (a small, host-bound model's drafting unit costs ~10 plain steps: every 450 units).
# The wait is the larger of this and the doubling period, so the budget decides the first waits
# and where a neighbour is dear: the 9B's never-right head at B = 8 on an H100 (k = 1 lost 2.4
# plain steps a unit) waited ~47 units for its first exploration at 0.05, ~108 at 0.02; later
# waits double to EXPLORE_MAX either way
EXPLORE_BUDGET = 0.02
# after the best k changed, the first exploration comes this soon, toward the old best: a best
# moved by one noisy unit time (a busy host) would otherwise hold for EXPLORE_EVERY units
EXPLORE_AFTER_CHANGE = 4
# an exploration of k = 0 runs this many plain units in a row: a plain step launched ahead of
# the one before (the steady state of plain decoding) is what k = 0 costs, and the first of a
# run is not launched ahead (observe_unit's `pipelined`)
EXPLORE_PLAIN_UNITS = 3
# the cold start runs at a B once this many units in a row had it: requests admitted one by one
# pass through every B on the way up (B = 2 .. 7 before 8), and a cold start at each, with the
# dearest k first, ran 7 units at 2-4x a step's cost (bench_speculative --batch 8); until then
# such units decode plainly
COLD_START_STREAK = 4
# the cold start's bound on a deeper k's tokens uses the first draft's acceptance once this
# many rows verified one (most_tokens); one unit at B = 8 gives as many
BOUND_TRIES = 4.0
PROBE_LOG = 64          # measuring units stats() lists (which unit, B, k), the first ones
COST_WEIGHT = 0.25      # running mean of T(B, k): the new unit's weight
ACCEPT_DECAY = 0.995    # the acceptance counts' decay per verify row (~200 rows' memory)
PRIOR_TRIES, PRIOR_ACCEPTS = 2.0, 1.0
ROW_DECAY = 0.9         # a row's own counts' decay per verify of that row (~10 verifies' memory)
ROW_PRIOR_TRIES = 2.0   # a row's acceptance starts as the traffic's, worth this many tries


def batch_key(rows: int) -> int:
    """Rows of a unit, bucketed: exact up to 8, else the next power of two."""
    return rows if rows <= 8 else 1 << (rows - 1).bit_length()


class DraftPolicy:
    def __init__(self, max_k: int, adaptive: bool = True,
                 cold_start_streak: int = COLD_START_STREAK):
        if max_k < 1:
            raise ValueError(f"DraftPolicy: max_k={max_k} must be >= 1")
        self.max_k, self.adaptive = int(max_k), bool(adaptive)
        self.cold_start_streak = int(cold_start_streak)
        # (Python floats: the policy runs on the host every unit, and numpy's per-call cost on
        # arrays of max_k entries is most of its time)
        self._tries = [0.0] * self.max_k           # decayed: rows that drafted position i ...
        self._accepts = [0.0] * self.max_k         # ... with drafts 1..i-1 accepted; of them, i too
        self._cost: dict = {}                      # (batch_key, k) -> running mean seconds
        self._since: dict = {}                     # batch_key -> units since its last exploration
        self._period: dict = {}                    # batch_key -> units between explorations
        self._last_best: dict = {}                 # batch_key -> the best k when last chosen
        self._explore_up: dict = {}                # batch_key -> next exploration goes up
        self._plain_left: dict = {}                # batch_key -> plain units left in a k = 0 run
        self._streak = (None, 0)                   # (batch_key, timed units in a row at it)
        self._pipelined: set = set()               # batch_keys whose k = 0 cost is pipelined
        self._rows: dict = {}                      # row id -> decayed (tries, accepts) of its own
        # the measuring account: units chosen to measure (cold start, exploration) and not yet
        # observed, the observed ones' [units, seconds], the timed units' seconds, and the
        # elapsed time before which a blocked exploration need not price the account again
        self._probes_due: dict = {}                # (batch_key, k) -> chosen, not yet observed
        self._probes: dict = {}                    # (batch_key, k) -> [units, seconds]
        self._elapsed = 0.0
        self._afford_at: dict = {}                 # batch_key -> elapsed seconds
        self._probe_log: list = []                 # "unit:BxK" of the first PROBE_LOG (stats)
        self.units_by_k = [0] * (self.max_k + 1)   # units run at each k (stats)
        self._observed: dict = {}                  # (batch_key, k) -> [units, seconds] (stats)

    # ---- the choice --------------------------------------------------------------------------
    def choose(self, rows: int, timed: bool = True, row_ids=None) -> int:
        """k for a unit of `rows` rows that can speculate (0: plain decoding); row_ids: theirs
        (observe_row's), whose own acceptance then sets E(k), else the traffic's. timed=False: the
        unit has other rows beside them (a prefill, a Replay, ...), so its time is not a cost
        the policy can use: it runs the best k known, never a cold start's or an exploration's
        (before any B is measured, 0: drafting blind could only lose; such units at the cold
        start's k ran each of them at up to twice a step's cost, bench_speculative --batch 8)."""
        if not self.adaptive or rows <= 0:
            k = self.max_k
        elif timed:
            k = self._choose(rows, row_ids)
        else:
            k = self.best(rows, row_ids) \
                if self._nearest_complete(batch_key(rows)) is not None else 0
        self.units_by_k[k] += 1
        return k

    def _choose(self, rows: int, row_ids) -> int:
        b = batch_key(rows)
        last, n = self._streak
        self._streak = (b, n + 1 if b == last else 1)
        if self._plain_left.get(b):                # within an exploration's run of k = 0
            self._plain_left[b] -= 1
            return self._probe(b, 0)
        if self._nearest_complete(b) is None:      # cold start: measure every k once ...
            if self._streak[1] < self.cold_start_streak:
                return 0                           # (... at a B that stays, not one passed)
            k = self._cold_start_k(b)
            if k is not None:
                return self._probe(b, k)
        best = self.best(rows, row_ids)
        old = self._last_best.get(b)
        if best != old:                            # a new best: explore around it soon again
            self._last_best[b] = best
            self._period[b] = EXPLORE_EVERY if old is None else EXPLORE_AFTER_CHANGE
            self._since[b] = 0
            if old is not None:                    # (toward the old best first)
                self._explore_up[b] = old > best
        since = self._since.get(b, 0) + 1
        period = self._period.get(b, EXPLORE_EVERY)
        # a neighbour of the best, alternately above and below; each run that leaves the best
        # where it was doubles the wait for the next (a neighbour that costs 1.5x a plain step
        # run every 32 units would cost 1.5%; every 256, 0.2%), and a neighbour far dearer
        # than the best waits until its unit is at most EXPLORE_BUDGET of the units since
        up = self._explore_up.get(b, True)
        k = best + (1 if (up and best < self.max_k) or best == 0 else -1)
        # (the first exploration after a change of the best keeps its EXPLORE_AFTER_CHANGE:
        # it checks a choice one noisy unit may have made, once a change)
        if since < period or (period > EXPLORE_AFTER_CHANGE
                              and (since < self._explore_wait(b, best, k, row_ids)
                                   or not self._affordable(b, best, k))):
            self._since[b] = since
            return best
        self._since[b] = 0
        self._period[b] = min(2 * period, EXPLORE_MAX)
        self._explore_up[b] = not up
        if k == 0:
            self._plain_left[b] = EXPLORE_PLAIN_UNITS - 1
        return self._probe(b, k)

    def _probe(self, b: int, k: int) -> int:
        """k, chosen to measure at batch key b (a cold start's or an exploration's unit): its
        time, once observed, goes to the measuring account (_affordable)."""
        self._probes_due[(b, k)] = self._probes_due.get((b, k), 0) + 1
        if len(self._probe_log) < PROBE_LOG:
            self._probe_log.append(f"{sum(self.units_by_k)}:{b}x{k}")
        return k

    def _affordable(self, b: int, best: int, k: int) -> bool:
        """Whether an exploration of k at batch key b keeps the measuring account within
        EXPLORE_BUDGET of the timed units' time: the measuring units observed so far, each
        priced at what it lost against its B's best k as known now (its seconds less the best's
        time for the tokens its k emits on average, E(k) / E(best) units of the best; nothing
        where its B's costs are not known yet), plus this one's expected loss. A blocked
        exploration waits until the time makes up the difference before it prices again (the
        policy runs every unit, and pricing every measured B took ~80 us on a 2-core host,
        ~4x a unit's choice and observation)."""
        if self._elapsed < self._afford_at.get(b, 0.0):
            return False
        e = self.expected_tokens()
        lost = self._unit_loss(b, best, k, self._estimate(b, k), e)
        bests = {}
        for (b2, k2), (n, seconds) in self._probes.items():
            if b2 not in bests:
                bests[b2] = self.best(b2)
            lost += n * self._unit_loss(b2, bests[b2], k2, seconds / n, e)
        if lost <= EXPLORE_BUDGET * self._elapsed:
            return True
        self._afford_at[b] = lost / EXPLORE_BUDGET
        return False

    def _unit_loss(self, b: int, best: int, k: int, seconds, e) -> float:
        """Seconds a unit at k taking `seconds` loses against the best k at batch key b."""
        t_best = self._estimate(b, best)
        if seconds is None or t_best is None:
            return 0.0
        return max(seconds - t_best * e[k] / e[best], 0.0)

    def _cold_start_k(self, b: int):
        """The cold start's next k at batch key b, or None once every k there has a cost: k = 0
        first (a run of plain units, one launched ahead; usually measured already by the plain
        units before the streak), then k = 1, 2, ... up to max_k. A unit at k costs at least
        what one at k - 1 does (a verify of more positions, more draft steps) and emits at most
        most_tokens(), so once a k costs that many plain steps no deeper k can beat plain
        decoding: those take that cost as theirs, a lower bound, unrun (a small model whose
        step is all host work: each drafting unit there costs ~10 plain steps, and measuring
        every k once cost more than a short run can win back; a head whose first drafts were
        all rejected: bench_speculative --batch 8, k = 2..4 ran at 1.6-1.8 plain steps each
        for nothing)."""
        if (b, 0) not in self._cost:
            self._plain_left[b] = EXPLORE_PLAIN_UNITS - 1
            return 0
        plain = self._cost[(b, 0)]
        for k in range(1, self.max_k + 1):
            if (b, k) in self._cost:
                continue
            prev = self._cost.get((b, k - 1))
            if k > 1 and prev >= self.most_tokens() * plain:
                for j in range(k, self.max_k + 1):
                    self._cost[(b, j)] = prev
                return None
            return k
        return None

    def most_tokens(self) -> float:
        """What a verify row can emit at any k, as far as the first draft's acceptance says:
        E(k) = 1 + sum_j prod_{i<=j} c_i <= 1 + max_k * c_1 (every product is at most c_1), with
        c_1 the traffic's once BOUND_TRIES first drafts were verified (before that max_k + 1:
        an untried head may be right every time)."""
        if self._tries[0] < BOUND_TRIES:
            return self.max_k + 1.0
        return 1.0 + self.max_k * (self._accepts[0] + PRIOR_ACCEPTS) / (self._tries[0]
                                                                          + PRIOR_TRIES)

    def _explore_wait(self, b: int, best: int, k: int, row_ids) -> float:
        """Units since the last exploration before one at k may run: the time a unit at k
        loses against the best, as a share of a best unit (T(k) / T(best) - E(k) / E(best)),
        over EXPLORE_BUDGET (0 where it loses nothing or nothing is known)."""
        costs = self._costs_at(b)
        if costs is None:
            return 0.0
        e = self.expected_tokens(row_ids)
        lost = costs[k] / max(costs[best], 1e-12) - e[k] / e[best]
        return max(lost, 0.0) / EXPLORE_BUDGET

    def best(self, rows: int, row_ids=None) -> int:
        """The k of the highest score at this B (the lowest k on ties): measured costs, or
        estimated ones (_estimate), or the nearest fully measured B's choice when nothing was
        measured at this one; max_k before any B is fully measured. row_ids: E(k) of these
        rows (expected_tokens)."""
        b = batch_key(rows)
        costs = self._costs_at(b)
        if costs is None:
            near = self._nearest_complete(b)
            if near is None:
                return self.max_k
            costs = self._costs_at(near)
        expected = self.expected_tokens(row_ids)
        return int(np.argmax([expected[k] / max(costs[k], 1e-12)
                              for k in range(self.max_k + 1)]))

    def _costs_at(self, b: int):
        """[max_k + 1] costs at batch key b, or None where one can be neither measured nor
        estimated."""
        costs = [self._estimate(b, k) for k in range(self.max_k + 1)]
        return None if any(c is None for c in costs) else costs

    def _estimate(self, b: int, k: int):
        """T(b, k): measured, else a k2 measured at b scaled by T(b2, k) / T(b2, k2) of the
        nearest batch key b2 that measured both (a unit's cost ratio between two ks changes
        slowly with B), else None. So a new B needs no round of every k."""
        own = self._cost.get((b, k))
        if own is not None:
            return own
        for b2 in self._by_distance(b):
            for k2 in range(self.max_k + 1):
                here, there, ref = (self._cost.get((b, k2)), self._cost.get((b2, k)),
                                    self._cost.get((b2, k2)))
                if here is not None and there is not None and ref:
                    return here * there / ref
        return None

    def _nearest_complete(self, b: int):
        """The nearest batch key (b itself included) with every k measured, or None."""
        for b2 in [b] + self._by_distance(b):
            if all((b2, k) in self._cost for k in range(self.max_k + 1)):
                return b2
        return None

    def _by_distance(self, b: int) -> list:
        """The other measured batch keys, nearest (in log2) first."""
        keys = {key for key, _ in self._cost} - {b}
        return sorted(keys, key=lambda b2: (abs(np.log2(b2) - np.log2(b)), b2))

    def expected_tokens(self, row_ids=None) -> np.ndarray:
        """[max_k + 1]: E(k), the tokens a verify row drafting k emits on average: over the
        traffic, or with row_ids the mean of those rows' own (each row's counts shrunk toward
        the traffic's acceptance by ROW_PRIOR_TRIES tries)."""
        cond = [(a + PRIOR_ACCEPTS) / (t + PRIOR_TRIES)
                for t, a in zip(self._tries, self._accepts)]
        rows = [cond]
        if row_ids:
            rows = []
            for r in row_ids:
                own = self._rows.get(r)
                rows.append(cond if own is None else
                            [(a + ROW_PRIOR_TRIES * c) / (t + ROW_PRIOR_TRIES)
                             for t, a, c in zip(own[0], own[1], cond)])
        out = [0.0] * (self.max_k + 1)
        for row in rows:
            prefix, total = 1.0, 1.0
            out[0] += 1.0
            for j, c in enumerate(row):
                prefix *= c
                total += prefix
                out[j + 1] += total
        return np.array(out) / len(rows)

    # ---- what was measured -------------------------------------------------------------------
    def observe_row(self, k: int, matched: int, row_id=None) -> None:
        """A verify row drafted k tokens and its first `matched` of them were accepted (by the
        sampling rule, before any stop or max_tokens cut); row_id: the row's own counts too
        (forget_row drops them)."""
        tried, kept = min(k, matched + 1), min(matched, k)
        counts = [(self._tries, self._accepts, ACCEPT_DECAY)]
        if row_id is not None:
            own = self._rows.get(row_id)
            if own is None:
                own = self._rows[row_id] = ([0.0] * self.max_k, [0.0] * self.max_k)
            counts.append((own[0], own[1], ROW_DECAY))
        for tries, accepts, decay in counts:
            for i in range(self.max_k):
                tries[i] = tries[i] * decay + (i < tried)
                accepts[i] = accepts[i] * decay + (i < kept)

    def forget_row(self, row_id) -> None:
        """The row left (released or paused): its own counts go."""
        self._rows.pop(row_id, None)

    def observe_unit(self, rows: int, k: int, seconds: float, pipelined: bool = False,
                     catch_up: float = 0.0) -> None:
        """A unit of `rows` rows at k took `seconds` (the time between its commit and the one
        before), besides `catch_up` seconds of feeding the drafter the positions it missed
        before its drafts (after plain units: what switching to drafting costs once, not what a
        unit at k costs; the measuring account pays it, as an exploration after plain units
        pays it each time: the 9B's k = 1 units at B = 8 on an H100 took 16.6 ms each with a
        catch-up of ~400 positions, a k = 1 unit at B = 1 or 2 ~10.3). pipelined: a plain step
        (k = 0) launched ahead of the one before, as plain decoding runs: once a B has such a
        time, its k = 0 cost is theirs alone (a plain step between speculative units runs
        alone, its host work not under a step before it, which made k = 0 look dearer than it
        is); until then (rows that never run ahead: penalties, grammars), any plain step's."""
        b = batch_key(rows)
        self._elapsed += seconds + catch_up
        due = self._probes_due.get((b, k), 0)
        if due:                 # a measuring unit: the account's (_affordable)
            self._probes_due[(b, k)] = due - 1
            seen = self._probes.setdefault((b, k), [0, 0.0])
            seen[0] += 1
            seen[1] += seconds + catch_up
        if k == 0 and b in self._pipelined and not pipelined:
            return
        if k == 0 and pipelined and b not in self._pipelined:
            self._pipelined.add(b)
            self._cost.pop((b, 0), None)           # the lone steps' mean is not plain decoding's
        key = (b, k)
        seen = self._observed.setdefault(key, [0, 0.0])
        seen[0] += 1
        seen[1] += seconds
        old = self._cost.get(key)
        if old is not None:     # one unit moves the mean by at most a quarter (a busy host)
            seconds = min(max(seconds, old / 2), 2 * old)
        self._cost[key] = seconds if old is None else old + COST_WEIGHT * (seconds - old)

    def stats(self) -> dict:
        """spec_unit_costs: "B x k" -> [units timed, their mean ms as measured, the policy's
        cost ms now (the clamped running mean)]: what the policy saw of each k at each batch
        key, for finding a cost it holds wrong (bench_speculative prints it);
        spec_measuring_units: "unit:BxK" of the first PROBE_LOG cold-start and exploration
        units (the unit's index among the policy's choices)."""
        costs = {f"{b}x{k}": [n, 1e3 * total / n, 1e3 * self._cost.get((b, k), float("nan"))]
                 for (b, k), (n, total) in sorted(self._observed.items())}
        return {"spec_adaptive": self.adaptive, "spec_units_by_k": list(self.units_by_k),
                "spec_expected_tokens_by_k": [float(e) for e in self.expected_tokens()],
                "spec_unit_costs": costs, "spec_measuring_units": list(self._probe_log)}
