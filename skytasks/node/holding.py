"""Who holds a node's agent, and for how long it stays up without one (warm pools, design 52 C.1).

Pure clocks: every method takes `now` (the agent's monotonic clock), so the rules are tested
with a fake time (tests/test_holding.py) and no clock is ever compared across machines.

    HELD(holder)       a LEASE came, or an ATTACH "hold" was admitted
    DETACHED(holder)   its stream broke: the same holder may "resume" within the window
    UNHELD             RELEASE, or the window ended on a warm lease: the next "hold" takes it
    EXPIRED            unheld for keep_warm seconds: the agent ends (and says so to its watchdog)

Without keep_warm (0, today's pools) a window that ends is the controller gone, and the agent
ends its ranks and itself as it always did.

One holder at a time, served in order: whoever asks to hold while another holds, or while an
older asker waits, gets a ticket (by its `who`), kept while it keeps asking; an unheld agent
admits only the oldest live ticket.
"""

from __future__ import annotations

from dataclasses import dataclass, field

HELD, DETACHED, UNHELD, EXPIRED = "held", "detached", "unheld", "expired"
# A waiter that has not asked again for this long has left the line (its process ended or gave up).
TICKET_SECONDS = 5.0
# What tick() asks the agent to do.
UNHOLD, END, EXPIRE = "unhold", "end", "expire"


@dataclass
class Ticket:
    who: str
    first_seen: float
    last_seen: float


@dataclass
class Holding:
    """The agent's holder and clocks, from its first LEASE on."""

    window: float = 0.0  # how long a broken stream waits for its holder (reattach_seconds + margin)
    keep_warm: float = 0.0  # how long the agent stays up unheld (0: it does not)
    state: str = HELD
    holder: str = ""  # the holder's id (LEASE/ATTACH `holder`)
    who: str = ""  # the holder in words
    since: float = 0.0  # when the current state began
    held_since: float = 0.0  # when the current holder took the agent
    tickets: dict[str, Ticket] = field(default_factory=dict)

    # -- what happens -------------------------------------------------------------------------

    def lease(self, holder: str, who: str, window: float, keep_warm: float, now: float) -> None:
        """A LEASE: held by `holder` (the process that started the agent, or one just admitted)."""
        if holder != self.holder or self.state != HELD:
            self.held_since = now
        if holder != self.holder:  # never its id: whoever holds the id may resume the holder's stream
            self.who = who or "another controller"
        elif who:
            self.who = who
        self.holder = holder
        self.window, self.keep_warm = max(0.0, window), max(0.0, keep_warm)
        self._enter(HELD, now)

    def broke(self, now: float) -> None:
        """The holder's stream broke (an end, a write error, silence)."""
        if self.state == HELD:
            self._enter(DETACHED, now)

    def resumed(self, now: float) -> None:
        """The same holder came back through the door within the window."""
        if self.state == DETACHED:
            self._enter(HELD, now)

    def released(self, now: float) -> None:
        """RELEASE: the holder lets go; the agent waits, unheld, for the next one."""
        if self.state in (HELD, DETACHED):
            self.holder = self.who = ""
            self._enter(UNHELD, now)

    def tick(self, now: float) -> str:
        """What the agent must do now: "" (nothing), UNHOLD (stop the ranks: the broken holder
        is not coming back; the agent stays up, unheld), END (not warm: the controller is gone,
        as before warm pools) or EXPIRE (unheld too long: end everything)."""
        if self.state == DETACHED and now >= self.since + self.window:
            if self.keep_warm <= 0:
                self._enter(EXPIRED, now)
                return END
            self.holder = self.who = ""
            self._enter(UNHELD, now)
            return UNHOLD
        if self.state == UNHELD and now >= self.since + self.keep_warm:
            self._enter(EXPIRED, now)
            return EXPIRE
        return ""

    def ask_hold(self, holder: str, who: str, now: float) -> tuple[str, float] | None:
        """An ATTACH "hold" from `who`: None when admitted (the agent is then HELD by `holder`
        on a fresh stream), else (whom it waits for, since when) for its REFUSED. The asker keeps
        its place in line as long as it asks again within TICKET_SECONDS."""
        self._prune(now)
        ticket = self.tickets.get(who)
        if ticket is None:
            ticket = self.tickets[who] = Ticket(who, now, now)
        ticket.last_seen = now
        if self.state in (HELD, DETACHED):
            return self.who or "another controller", self.held_since
        if self.state != UNHELD:
            return "nobody: the node is ending", now
        first = min(self.tickets.values(), key=lambda t: t.first_seen)
        if first.who != who:
            return f"{first.who} (waiting in line before you)", first.first_seen
        del self.tickets[who]
        self.holder, self.who, self.held_since = holder, who, now
        self._enter(HELD, now)
        return None

    # -- what is said of it ---------------------------------------------------------------------

    @property
    def touches(self) -> bool:
        """Whether the node is wanted now (its watchdog's heartbeat file is kept fresh)."""
        return self.state in (HELD, UNHELD)

    def expires_in(self, now: float) -> float | None:
        """Seconds until an unheld agent expires; None while held (or not warm)."""
        if self.state != UNHELD:
            return None
        return max(0.0, self.since + self.keep_warm - now)

    def describe(self, now: float, wall: float) -> dict[str, float | str]:
        """The holding part of ATTACHED's `state`, in epoch seconds (`wall` is time.time() at `now`)."""
        def epoch(t: float) -> float:
            return round(wall - (now - t), 3)

        out: dict[str, float | str] = {"holding": self.state, "holder": self.who if self.state in (HELD, DETACHED) else "",
                                       "held_since": epoch(self.held_since) if self.state in (HELD, DETACHED) else 0.0}
        if self.state == UNHELD:
            out["unheld_since"] = epoch(self.since)
            left = self.expires_in(now)
            if self.keep_warm > 0 and left is not None:
                out["expires_at"] = round(wall + left, 3)
        return out

    def _enter(self, state: str, now: float) -> None:
        self.state, self.since = state, now

    def _prune(self, now: float) -> None:
        for who in [w for w, t in self.tickets.items() if now - t.last_seen > TICKET_SECONDS]:
            del self.tickets[who]
