"""The terminal chat (`salabatch chat`): a conversation with the serving engine in this process,
no HTTP. Documents go in the system message, so they are prefilled once: every turn's prompt
starts with them, and the engine finds the longest prefix it holds (the documents, then the
conversation up to the last message of the turn before), so a turn costs only its own tokens.

`run_chat` is the loop: a line is a question, or a command: `/document FILE` (one more
document, text or PDF, read as `salabatch run` reads it: it joins the system message, so the
next question prefills it, with the conversation after it), `/reset` (forget the conversation,
keep the documents), `/save FILE` (the conversation as JSON), `/load FILE` (a saved one, to go
on with), `/help`, `/quit`. Answers stream as they come; Ctrl-C stops the answer (its job is
cancelled), not the session. After each answer a line says its tokens, the prompt's cached
tokens and the speed.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from salabatch.engine.sampling import SamplingParams
from salabatch.engine.tokenizer import Tokenizer
from salabatch.errors import SalabatchError, Terminated, not_utf8
from salabatch.serve.completion import AnswerText, LeadingIds, Piece, chat_job
from salabatch.serve.engine import Finished, ServeEngine, Token

HELP = (
    "/document FILE adds a document, /reset forgets the conversation (not the documents), "
    "/save FILE writes it as JSON, /load FILE goes on with a saved one, /quit"
)
MAX_DOCUMENT_TOKENS = 1 << 20  # a document over the bytes this many tokens allows is refused unread
STATUS_S = 1.0  # how often the prefill's progress is shown while the first token is awaited


class ChatError(SalabatchError):
    """A document that cannot be read, or a saved conversation that cannot be loaded: the
    message names the file."""

    exit_code = 2


def read_document(path: str | Path) -> tuple[str, str]:
    """(name, text) of a document file, read as `salabatch run` reads it (text or PDF); a file
    that gives no text is a ChatError naming it and why."""
    from salabatch.jobs.ingest.documents import DocumentSource, iter_documents

    path = Path(path).expanduser()
    if path.is_dir():
        raise ChatError(f"{path}: a directory, not a document file")
    if not path.is_file():
        raise ChatError(f"{path}: no such file")
    docs = list(iter_documents([DocumentSource(str(path), max_tokens=MAX_DOCUMENT_TOKENS)]))
    bad = next((d for d in docs if not d.ok), None)
    if bad is not None or not docs:
        raise ChatError(f"{path}: {bad.error if bad is not None else 'no document in it'}")
    # a name's bytes that are no UTF-8 (Python holds them as surrogates) as U+FFFD: the name
    # goes into the prompt
    name = path.name.encode("utf-8", "surrogateescape").decode("utf-8", "replace")
    return name, "\n\n".join(d.text for d in docs)


@dataclass(frozen=True)
class Turn:
    """How one answer went: the engine's counts and timings; or, when Ctrl-C stopped it
    ("cancelled"), the tokens that came (the prompt's counts unknown: 0)."""

    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    ttft_s: float
    decode_s: float
    finish_reason: str  # "stop", "length" or "cancelled"
    draft_tokens: int = 0  # speculative decoding: tokens drafted, and of those accepted
    accepted_tokens: int = 0

    @property
    def decode_tok_s(self) -> float | None:
        """Tokens per second after the first, as the engine counts (`Generation.decode_tok_s`,
        what `salabatch generate` shows): decode_s starts at the first token, so it spans
        n − 1 of them (counting all n showed a short answer up to twice as fast); None for
        fewer than two tokens."""
        steps = self.completion_tokens - 1
        return steps / self.decode_s if steps > 0 and self.decode_s > 0 else None

    def summary(self) -> str:
        """The line shown after an answer."""
        rate = "–" if self.decode_tok_s is None else f"{self.decode_tok_s:.1f}"
        if self.finish_reason == "cancelled":  # the engine's counts never came
            return f"[stopped after {self.completion_tokens} tokens, {rate} tok/s]"
        drafts = (
            f"drafts {self.accepted_tokens}/{self.draft_tokens} accepted; "
            if self.draft_tokens
            else ""
        )
        return (
            f"[{self.completion_tokens} tokens, {rate} tok/s; prompt {self.prompt_tokens} "
            f"tokens, {self.cached_tokens} cached; {drafts}first token after "
            f"{self.ttft_s:.2f} s; {self.finish_reason}]"
        )


class ChatSession:
    """One conversation: the system message (`system`, then each document as
    `Document: NAME` and its text), the turns so far, and the engine that answers them.
    `add_document` puts one more in the system message; `save` and `load` keep a conversation
    in a JSON file."""

    def __init__(
        self,
        engine: ServeEngine,
        tok: Tokenizer,
        *,
        documents: Sequence[tuple[str, str]] = (),
        system: str | None = None,
        params: SamplingParams | None = None,
        max_tokens: int = 512,
        think: bool = False,
    ) -> None:
        self.engine, self.tok = engine, tok
        self.documents: list[str] = []
        self._parts = [system] if system else []  # the system message's, in order
        for name, text in documents:
            self.add_document(name, text)
        self.params = params or SamplingParams()  # greedy
        self.max_tokens, self.think = max_tokens, think
        self.history: list[dict] = []
        self.leading_ids = LeadingIds(tok)  # the system message (the documents) tokenized once
        self._trailer: int | None = None  # tokens the template writes after a system message

    @property
    def system(self) -> list[dict]:
        """The system message (none without a system prompt or document)."""
        return [{"role": "system", "content": "\n\n".join(self._parts)}] if self._parts else []

    @property
    def messages(self) -> list[dict]:
        return self.system + self.history

    def _documents_end(self) -> int:
        """Where the system message's text ends in the prompt, before the template's end of
        turn (0: no system message): held there, a document added after it (or a /reset)
        resumes from the documents before it, where the end of the whole system message
        would no longer be a prefix."""
        if not self._parts:
            return 0
        if self._trailer is None:

            def ids(text: str) -> list[int]:
                message = [{"role": "system", "content": text}]
                return self.tok.chat_prompt_ids(
                    message, think=self.think, add_generation_prompt=False
                )

            one, more = ids("Notes."), ids("Notes.\n\nMore notes.")
            same = next(
                (i for i, (a, b) in enumerate(zip(one, more, strict=False)) if a != b), len(one)
            )
            self._trailer = len(one) - same
        return len(self.leading_ids.ids(self.system, self.think)) - self._trailer

    def add_document(self, name: str, text: str) -> None:
        """Puts a document after those in the system message (`Document: NAME`, then its
        text): the next question prefills the system message from where it changed, and the
        conversation so far after it."""
        self.documents.append(name)
        self._parts.append(f"Document: {name}\n\n{text.strip()}")

    def ask(
        self,
        question: str,
        show: Callable[[Piece], None],
        status: Callable[[str], None] | None = None,
        every: float = STATUS_S,
    ) -> Turn:
        """Answers `question`, its pieces streamed through `show` (reasoning pieces only with
        `think`). Until the first token, `status` gets the prefill's progress every `every`
        seconds ("prefilling 65,536 of 412,000 prompt tokens"), then "" once (what it showed
        is over). A KeyboardInterrupt (Ctrl-C) stops the answer: the job is cancelled and the
        text so far kept as the answer. A job the engine fails raises its error."""
        messages = [*self.messages, {"role": "user", "content": question}]
        answer = AnswerText(self.tok, think=self.think)
        start = time.perf_counter()
        first_at = None
        finished: Finished | None = None
        ticket, received, shown = None, 0, False
        try:
            job = chat_job(
                self.tok,
                messages,
                think=self.think,
                params=self.params,
                max_tokens=self.max_tokens,
                leading_ids=self.leading_ids,
            )
            if (end := self._documents_end()) and end < len(job.prompt):
                job = replace(job, boundaries=tuple(sorted({*job.boundaries, end})))
            ticket = self.engine.submit(job)
            while finished is None:
                event = ticket.next_event(every if status and first_at is None else None)
                if event is None:  # still waiting for the first token
                    status(f"prefilling {ticket.prefilled:,} of {len(job.prompt):,} prompt tokens")
                    shown = True
                    continue
                if shown:
                    status("")
                    shown = False
                if isinstance(event, Token):
                    first_at = first_at or time.perf_counter()
                    received += 1
                    pieces = answer.add(event.token)
                elif isinstance(event, Finished):
                    finished, pieces = event, answer.finish(event)
                else:
                    raise event.error
                for piece in pieces:
                    show(piece)
        except KeyboardInterrupt as e:
            if ticket is None or isinstance(e, Terminated):  # SIGTERM: the session ends
                raise
        finally:
            if ticket is not None and finished is None:
                ticket.cancel()  # Ctrl-C, or an error: the job stops (a no-op once it ended)
            if shown:
                status("")
        self.history += messages[-1:] + [{"role": "assistant", "content": answer.content}]
        if finished is not None:
            return Turn(
                finished.prompt_tokens,
                finished.cached_tokens,
                finished.completion_tokens,
                finished.ttft_s,
                finished.decode_s,
                finished.finish_reason,
                finished.draft_tokens,
                finished.accepted_tokens,
            )
        now = time.perf_counter()
        ttft = (first_at or now) - start
        return Turn(0, 0, received, ttft, now - (first_at or now), "cancelled")

    def reset(self) -> None:
        """Forgets the conversation; the documents stay (and stay prefilled)."""
        self.history = []

    def save(self, path: str | Path) -> None:
        """The conversation as JSON: the documents' names and the messages, system first."""
        record = {"documents": self.documents, "messages": self.messages}
        Path(path).expanduser().write_text(json.dumps(record, ensure_ascii=False, indent=2) + "\n")

    def load(self, path: str | Path) -> None:
        """Goes on with a conversation `save` wrote (here or in another session): its system
        message (documents included) and turns replace this one's. A file that is not such a
        conversation is a ChatError naming it and what is wrong; this one is then kept."""
        path = Path(path).expanduser()
        try:
            record = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ChatError(f"{path}: {getattr(e, 'strerror', None) or e}") from None
        messages = record.get("messages") if isinstance(record, dict) else None
        names = record.get("documents", []) if isinstance(record, dict) else None
        if not isinstance(messages, list) or not isinstance(names, list):
            raise ChatError(f"{path}: not a saved conversation (no messages and documents)")
        for i, m in enumerate(messages):
            roles = ("system", "user", "assistant") if i == 0 else ("user", "assistant")
            if not (
                isinstance(m, dict) and m.get("role") in roles and isinstance(m.get("content"), str)
            ):
                raise ChatError(
                    f"{path}: messages[{i}] is not a {'/'.join(roles)} message with text content"
                )
        for text in [*(m["content"] for m in messages), *names]:
            if bad := not_utf8(str(text), from_bytes=False):
                raise ChatError(f"{path}: a text UTF-8 cannot hold ({bad}) in its messages")
        system = messages[:1] if messages and messages[0]["role"] == "system" else []
        self._parts = [system[0]["content"]] if system else []
        self.documents = [str(n) for n in names]
        self.history = [
            {"role": m["role"], "content": m["content"]} for m in messages[len(system) :]
        ]


def run_chat(
    session: ChatSession,
    read_line: Callable[[], str | None],
    write: Callable[[str], None],
    note: Callable[[str], None],
    dim: Callable[[str], str] = str,
    status: Callable[[str], None] | None = None,
) -> None:
    """The chat loop: reads lines (`read_line`: None at the end of input) until /quit or the
    end; answers stream through `write` (reasoning styled by `dim`), summaries, notices and
    errors go to `note` (one line each), a long prefill's progress to `status` (`ask`'s).
    Ctrl-C while reading a line only starts a new one; Ctrl-C while the prompt is still being
    tokenized drops the question; SIGTERM (`Terminated`) ends the session wherever it comes."""

    def show(piece: Piece) -> None:
        write(piece.text if piece.channel == "content" else dim(piece.text))

    while True:
        try:
            line = read_line()
        except KeyboardInterrupt as e:
            if isinstance(e, Terminated):  # SIGTERM ends the session (exit 143), Ctrl-C a line
                raise
            write("\n")
            continue
        if line is None:
            return
        line = line.strip()
        if not line:
            continue
        command, _, argument = line.partition(" ")
        if command in ("/quit", "/exit"):
            return
        if command == "/help":
            note(HELP)
        elif command in ("/document", "/load"):
            target = argument.strip()
            if not target:
                note(f"usage: {command} FILE")
                continue
            try:
                if command == "/load":
                    session.load(target)
                    note(f"[loaded {target}: {len(session.history)} messages]")
                else:
                    name, text = read_document(target)
                    session.add_document(name, text)
                    note(
                        f"[added {name} ({len(text):,} characters): the next question prefills it]"
                    )
            except ChatError as e:
                note(f"error: {e}")
        elif command == "/reset":
            session.reset()
            note("[the conversation is forgotten; the documents stay]")
        elif command == "/save":
            if not argument.strip():
                note("usage: /save FILE")
                continue
            try:
                session.save(argument.strip())
            except OSError as e:
                note(f"cannot save to {argument.strip()}: {e.strerror or e}")
            else:
                note(f"[saved to {argument.strip()}]")
        elif command.startswith("/") and " " not in command and len(command) > 1:
            note(f"unknown command {command}: {HELP}")
        else:
            try:
                turn = session.ask(line, show, status)
            except KeyboardInterrupt as e:
                if isinstance(e, Terminated):
                    raise
                note("[stopped before the answer began; the question is dropped]")
                continue
            except SalabatchError as e:
                write("\n")
                note(f"error: {e}")
                continue
            write("\n")
            note(turn.summary())
