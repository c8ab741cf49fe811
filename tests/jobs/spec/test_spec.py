"""The job file: schema, path resolution, one located line per mistake, check_paths, identities
(files that are not job files and --set overrides: test_job_yaml.py)."""

from __future__ import annotations

import re
import textwrap
from pathlib import Path

import pytest

from salabatch.engine.speculative import DRAFTS
from salabatch.errors import JobSpecError, JobValidationError
from salabatch.jobs.ingest.documents import DocumentSource
from salabatch.jobs.spec.load import check_paths, load_job
from salabatch.jobs.spec.models import (
    JobSpec,
    Speculative,
    generation_key,
    spec_fingerprint,
    spec_json,
)

DESIGN_JOB = """\
name: contracts-review
model: ~/models/MiniCPM-SALA-8bit
documents:
  - path: ./contracts
    glob: "**/*.pdf"
questions:
  - id: summary
    text: "Summarize this document in five bullet points."
  - id: parties
    text: "Who are the parties, and what does each one owe?"
generation: {max_tokens: 512, temperature: 0.0, top_p: 1.0, seed: 0, think: false}
engine: {prefill_chunk: 2048, batch_size: 8, dtype: auto, max_context: 1048576}
cache: {dir: ~/.cache/salabatch, max_gb: 50}
output: {path: results/contracts.parquet}
"""

MINIMAL = """\
name: mini
model: builtin:random
documents: [{path: docs}]
questions: [{text: Summarize.}]
"""


def write(folder: Path, text: str, name: str = "job.yaml") -> Path:
    path = folder / name
    path.write_text(textwrap.dedent(text), encoding="utf-8")
    return path


def errors_of(path: Path, overrides: tuple[str, ...] = ()) -> list[str]:
    with pytest.raises(JobValidationError) as info:
        load_job(path, overrides)
    assert str(info.value).startswith(str(path))
    return info.value.errors


def error_of(path: Path, overrides: tuple[str, ...] = ()) -> str:
    (error,) = errors_of(path, overrides)
    return error


# ---- valid jobs ---------------------------------------------------------------------------------


def test_design_job_resolves_paths_against_the_job_file_and_home(tmp_path, home):
    jobs = tmp_path / "jobs"
    jobs.mkdir()
    spec = load_job(write(jobs, DESIGN_JOB))
    assert spec.name == "contracts-review"
    assert spec.model == str(home / "models" / "MiniCPM-SALA-8bit")
    (entry,) = spec.documents
    assert entry.path == jobs / "contracts" and entry.glob == "**/*.pdf"
    assert [q.id for q in spec.questions] == ["summary", "parties"]
    assert spec.cache.dir == home / ".cache" / "salabatch"
    assert spec.output.path == jobs / "results" / "contracts.parquet"
    results = jobs / "results"
    # the job's own files: never read as documents (it writes no Batch output)
    own = (results / "contracts.parquet", results / "contracts.parquet.parts")
    assert spec.sources() == [
        DocumentSource(jobs / "contracts", "**/*.pdf", "text", "id", max_tokens=1048576, skip=own)
    ]


def test_defaults(tmp_path, home):
    spec = load_job(write(tmp_path, MINIMAL))
    assert spec.model == "builtin:random" and spec.model_is_builtin
    assert spec.requests is None and spec.system is None
    g, e, c = spec.generation, spec.engine, spec.cache
    assert (g.max_tokens, g.temperature, g.top_p, g.top_k) == (512, 0.0, 1.0, 0)
    assert (g.repetition_penalty, g.seed, g.think) == (1.0, 0, False)
    assert (e.prefill_chunk, e.batch_size, e.dtype) == (2048, 8, "auto")
    assert (e.max_context, e.on_overflow) == (1048576, "error")
    assert e.pool_max_tokens == 2048
    assert (c.dir, c.max_gb, c.enabled, c.snapshot_every) == (
        home / ".cache" / "salabatch",
        50.0,
        True,
        32768,
    )
    assert spec.output.path == tmp_path / "results" / "mini.parquet"
    assert spec.documents[0].text_field == "text" and spec.documents[0].id_field == "id"


def test_speculative_decoding_settings(tmp_path):
    assert load_job(write(tmp_path, MINIMAL)).engine.speculative == Speculative(
        draft="auto", tokens=4, layers=8
    )
    # unquoted `off` is YAML's false: the user wrote off
    job = write(tmp_path, MINIMAL + "engine:\n  speculative: {draft: off, tokens: 16}\n")
    assert load_job(job).engine.speculative == Speculative(draft="off", tokens=16, layers=8)
    for value in ("off", "'off'", "lookup"):
        set_ = load_job(job, [f"engine.speculative.draft={value}", "engine.speculative.layers=2"])
        assert set_.engine.speculative == Speculative(draft=value.strip("'"), tokens=16, layers=2)
    # the job file's names are the engine's
    assert Speculative.model_fields["draft"].annotation.__args__ == DRAFTS


def test_glob_paths_keep_their_pattern_and_jsonl_fields(tmp_path):
    spec = load_job(
        write(
            tmp_path,
            """\
            name: g
            model: ../models/sala
            documents:
              - {path: "data/**/*.md"}
              - {path: /abs/records.jsonl, text_field: body, id_field: key}
            questions: [{text: q}]
            """,
        )
    )
    assert spec.model == str(tmp_path.parent / "models" / "sala")
    assert spec.documents[0].path == tmp_path / "data" / "**" / "*.md"
    assert spec.documents[1].to_source() == DocumentSource(
        Path("/abs/records.jsonl"), None, "body", "key"
    )


def test_auto_ids_and_per_question_overrides(tmp_path):
    spec = load_job(
        write(
            tmp_path,
            """\
            name: ids
            model: builtin:random
            documents: [{path: d}]
            generation: {max_tokens: 100, temperature: 0.5}
            questions:
              - text: "  first\\n"
              - {id: 7, text: second, max_tokens: 20, think: true}
              - text: third
            """,
        )
    )
    assert [q.id for q in spec.questions] == ["q1", "7", "q3"]
    assert spec.questions[0].text == "first"
    key = generation_key(spec, spec.questions[1])
    assert (key["max_tokens"], key["think"], key["temperature"]) == (20, True, 0.5)
    assert generation_key(spec, spec.questions[0])["max_tokens"] == 100


def test_logprobs_enter_a_rows_key_only_when_set(tmp_path):
    """A job that asks for no log-probabilities keys its rows as before they existed."""
    text = "name: lp\nmodel: builtin:random\ndocuments: [{path: d}]\nquestions: [first]\n"
    plain = load_job(write(tmp_path, text))
    assert "logprobs" not in generation_key(plain, plain.questions[0])
    asked = load_job(write(tmp_path, text + "generation: {logprobs: 3}\n"))
    assert generation_key(asked, asked.questions[0])["logprobs"] == 3


def test_questions_given_as_plain_strings(tmp_path):
    job = write(
        tmp_path,
        """\
        name: plain
        model: builtin:random
        documents: [{path: d}]
        questions:
          - Who signed it?
          - {id: when, text: "When?"}
          - "What does it cost?"
        """,
    )
    spec = load_job(job)
    assert [(q.id, q.text) for q in spec.questions] == [
        ("q1", "Who signed it?"),
        ("when", "When?"),
        ("q3", "What does it cost?"),
    ]
    assert (
        error_of(job, ("questions[0]=''",))
        == "questions[0].text: must not be empty (from the command line)"
    )


def test_a_documents_entry_format_is_text_pdf_or_jsonl(tmp_path):
    job = write(tmp_path, MINIMAL.replace("[{path: docs}]", "[{path: LICENSE, format: text}]"))
    assert load_job(job).sources()[0].format == "text"
    assert error_of(job, ("documents[0].format=docx",)) == (
        "documents[0].format: must be 'text', 'pdf' or 'jsonl', got 'docx' (from the command line)"
    )


def test_numbers_are_fine_as_names_and_ids(tmp_path):
    spec = load_job(write(tmp_path, MINIMAL.replace("name: mini", "name: 2024"), "n.yaml"))
    assert spec.name == "2024" and spec.output.path == tmp_path / "results" / "2024.parquet"
    assert load_job(write(tmp_path, MINIMAL, "m.yaml"), ["name=7"]).name == "7"


def test_requests_only_job_is_valid(tmp_path):
    spec = load_job(write(tmp_path, "name: r\nmodel: builtin:random\nrequests: batch.jsonl\n"))
    assert spec.requests == tmp_path / "batch.jsonl"
    assert spec.documents == [] and spec.questions == []


def test_command_line_paths_are_relative_to_the_current_directory(tmp_path, monkeypatch):
    job = write(tmp_path, MINIMAL)
    monkeypatch.chdir(tmp_path.parent)
    spec = load_job(job, requests="in.jsonl", output="out/x.parquet")
    assert spec.requests == tmp_path.parent / "in.jsonl"
    assert spec.output.path == tmp_path.parent / "out" / "x.parquet"


# ---- mistakes, one located line each -----------------------------------------------------------


def test_unknown_top_level_key_lists_allowed_fields(tmp_path):
    error = error_of(write(tmp_path, MINIMAL + "colour: red\n"))
    assert error.startswith("colour: unknown field (allowed: name, model, documents, questions,")
    assert error.endswith("(line 5)")


def test_unknown_nested_key_suggests_the_close_one(tmp_path):
    error = error_of(write(tmp_path, MINIMAL + "engine: {batchsize: 4}\n"))
    assert error.startswith("engine.batchsize: unknown field, did you mean 'batch_size'?")
    allowed = (
        "prefill_chunk, batch_size, dtype, max_context, on_overflow, pool_max_tokens, speculative"
    )
    assert f"(allowed: {allowed})" in error


def test_missing_question_text_is_located(tmp_path):
    job = write(
        tmp_path,
        """\
        name: m
        model: builtin:random
        documents: [{path: d}]
        questions:
          - text: a
          - text: b
          - id: third
        """,
    )
    assert error_of(job) == "questions[2].text: field required (line 7)"


def test_bad_types_and_values_are_located(tmp_path):
    job = write(
        tmp_path,
        MINIMAL
        + """\
engine:
  batch_size: "four"
  dtype: fp16
generation:
  temperature: -1
  top_p: 0
  think: 1
cache: {max_gb: .nan}
""",
    )
    assert errors_of(job) == [
        "generation.temperature: must be greater than or equal to 0, got -1 (line 9)",
        "generation.top_p: must be greater than 0, got 0 (line 10)",
        "generation.think: expected true or false, got 1 (line 11)",
        "engine.batch_size: expected an integer, got 'four' (line 6)",
        "engine.dtype: must be 'auto', 'float32', 'bfloat16' or 'float16', got 'fp16' (line 7)",
        "cache.max_gb: expected a finite number, got nan (line 12)",
    ]


def test_bad_speculative_settings_name_their_field(tmp_path):
    job = write(
        tmp_path,
        MINIMAL + "engine:\n  speculative:\n    draft: medusa\n    tokens: 0\n    layers: '8'\n",
    )
    assert errors_of(job) == [
        "engine.speculative.draft: must be 'off', 'lookup', 'layers' or 'auto', got 'medusa' "
        "(line 7)",
        "engine.speculative.tokens: must be greater than or equal to 1, got 0 (line 8)",
        "engine.speculative.layers: expected an integer, got '8' (line 9)",
    ]
    job = write(tmp_path, MINIMAL + "engine: {speculative: {draft: yes, tokens: 17, layers: 0}}\n")
    assert errors_of(job) == [
        "engine.speculative.draft: must be 'off', 'lookup', 'layers' or 'auto', got true (line 5)",
        "engine.speculative.tokens: must be less than or equal to 16, got 17 (line 5)",
        "engine.speculative.layers: must be greater than or equal to 1, got 0 (line 5)",
    ]
    error = error_of(write(tmp_path, MINIMAL + "engine: {speculative: {draft_tokens: 2}}\n"))
    assert error.startswith("engine.speculative.draft_tokens: unknown field")
    assert "(allowed: draft, tokens, layers)" in error


def test_every_mistake_is_reported_at_once(tmp_path):
    job = write(
        tmp_path,
        """\
        name: "my job"
        model: builtin:huge
        documents: [{path: d, glob: ""}]
        questions: [{id: a, text: x}, {id: a, text: ""}, {id: "b c", text: y}]
        """,
    )
    errors = errors_of(job)
    assert errors[0].startswith("name: must be 1 to 100 letters, digits, _ . -")
    assert "got 'my job'; try 'my-job'" in errors[0]
    assert errors[1].startswith("model: unknown builtin model 'builtin:huge' (available: builtin:")
    assert errors[2].startswith("documents[0].glob: must not be empty")
    assert errors[3] == "questions[1].text: must not be empty (line 4)"
    assert errors[4].startswith("questions[2].id: must be 1 to 100 letters")
    # Cross-field checks run even though fields failed.
    assert errors[5] == "questions[1].id: duplicate id 'a' (also questions[0].id) (line 4)"
    assert len(errors) == 6


def test_duplicate_question_ids_name_the_later_one(tmp_path):
    job = write(
        tmp_path,
        """\
        name: d
        model: builtin:random
        documents: [{path: d}]
        questions:
          - {id: x, text: a}
          - {id: q3, text: b}
          - {text: c}
          - {id: x, text: d}
        """,
    )
    assert errors_of(job) == [
        "questions[2].id: duplicate id 'q3' (also questions[1].id); a question without an id "
        "is q<position> (line 7)",
        "questions[3].id: duplicate id 'x' (also questions[0].id) (line 8)",
    ]


def test_what_to_do_is_required(tmp_path):
    no_questions = write(
        tmp_path, "name: a\nmodel: builtin:random\ndocuments: [{path: d}]\n", "a.yaml"
    )
    assert error_of(no_questions).startswith("questions: field required: documents need questions")
    no_documents = write(
        tmp_path, "name: b\nmodel: builtin:random\nquestions: [{text: q}]\n", "b.yaml"
    )
    assert error_of(no_documents).startswith("documents: field required: questions need documents")
    nothing = write(tmp_path, "name: c\nmodel: builtin:random\n", "c.yaml")
    assert error_of(nothing).startswith("documents: nothing to do")
    assert errors_of(write(tmp_path, "documents: []\n", "d.yaml")) == [
        "name: field required",
        "model: field required",
        "documents: nothing to do: give documents and questions, or requests (line 1)",
    ]


def test_an_answer_that_leaves_no_room_for_a_document_is_refused(tmp_path):
    """max_tokens at or past engine.max_context makes every row an error row: the job says so
    before it runs, at the field given (a question's, the job's, or the context where the
    default max_tokens of 512 does not fit)."""
    job = write(
        tmp_path,
        """\
        name: room
        model: builtin:random
        documents: [{path: d}]
        questions:
          - {text: a, max_tokens: 300}
          - {text: b}
        engine: {max_context: 300}
        """,
    )
    assert errors_of(job) == [
        "questions[0].max_tokens: 300 leaves no room for a document within engine.max_context "
        "300 (the document, question and answer together): lower it or raise "
        "engine.max_context (line 5)",
        "engine.max_context: 300 leaves no room for a document beside answers of "
        "generation.max_tokens (default 512): raise it or give a lower generation.max_tokens "
        "(line 7)",
    ]
    (given,) = errors_of(job, ("generation.max_tokens=400", "questions.0.max_tokens=8"))
    assert given.startswith("generation.max_tokens: 400 leaves no room for a document")
    assert given.endswith("(from the command line)")
    load_job(job, ("generation.max_tokens=299", "questions.0.max_tokens=8"))
    load_job(job, ("engine.max_context=513",))  # the default 512 fits
    (wrong,) = errors_of(job, ("generation.max_tokens=lots", "questions.0.max_tokens=8"))
    assert wrong.startswith("generation.max_tokens: ") and "room" not in wrong


def test_a_name_or_question_id_that_reads_as_a_number_is_kept_as_written(tmp_path):
    """`name: 007` wrote results/7.parquet; ids `01`, `1e3`, `0x10` became 1, 1000.0, 16 in
    every custom_id. Quoted or not, they are what the file says."""
    questions = "[{id: 01, text: a}, {id: 1e3, text: b}, {id: '0x10', text: c}, 2.50]"
    job = write(tmp_path, MINIMAL.replace("name: mini", "name: 007").replace(
        "[{text: Summarize.}]", questions))  # fmt: skip
    spec = load_job(job)
    assert spec.name == "007" and spec.output.path.name == "007.parquet"
    assert [(q.id, q.text) for q in spec.questions] == [
        ("01", "a"), ("1e3", "b"), ("0x10", "c"), ("q4", "2.50")
    ]  # fmt: skip
    assert load_job(job, ("name=2024",)).name == "2024"  # from the command line: a number


def test_a_key_yaml_reads_as_a_boolean_or_null_is_named_as_written_with_its_line(tmp_path):
    """`on:`, `no:`, `~:` were named `1`, `0` and `None`, the top level ones without a line."""
    for key, where in [("generation: {on: 3}", "generation.on"), ("no: 3", "no"), ("~: 3", "~")]:
        error = error_of(write(tmp_path, MINIMAL + key + "\n"))
        assert error.startswith(f"{where}: unknown field") and error.endswith("(line 5)"), error
    schema = "[{text: a, json_schema: {type: object, properties: {yes: {type: string}}}}]"
    spec = load_job(write(tmp_path, MINIMAL.replace("[{text: Summarize.}]", schema)))
    assert list(spec.questions[0].json_schema["properties"]) == ["yes"]


def test_glob_on_a_glob_path_is_refused(tmp_path):
    job = write(tmp_path, MINIMAL.replace("{path: docs}", "{path: 'docs/*.md', glob: '*.txt'}"))
    assert error_of(job).startswith("documents[0].glob: path is already a glob pattern")


def test_duplicate_yaml_keys_are_reported(tmp_path):
    job = write(tmp_path, MINIMAL + "engine: {batch_size: 2}\nengine: {batch_size: 3}\n")
    assert error_of(job) == "engine: duplicate key (line 6; first at line 5)"


def test_one_error_is_one_line_and_several_are_listed(tmp_path):
    job = write(tmp_path, MINIMAL + "colour: red\nsize: 3\n")
    with pytest.raises(JobSpecError) as info:
        load_job(job)
    text = str(info.value)
    assert text.splitlines()[0] == f"{job}: 2 errors"
    assert text.splitlines()[1].startswith("  colour: unknown field")
    assert info.value.exit_code == 2


# ---- the disk: check_paths ---------------------------------------------------------------------


def test_check_paths_reports_every_entry_with_its_index(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.txt").write_text("hello")
    (tmp_path / "notes.docx").write_text("x")
    (tmp_path / "model").mkdir()
    job = write(
        tmp_path,
        """\
        name: paths
        model: model
        requests: missing.jsonl
        documents:
          - path: docs
          - path: nowhere
          - path: docs
            glob: "*.pdf"
        questions: [{text: q}]
        """,
    )
    assert check_paths(load_job(job)) == [
        f"model: no config.json in {tmp_path / 'model'} (expected a checkpoint folder)",
        f"requests: no such file: {tmp_path / 'missing.jsonl'} (expected a .jsonl file)",
        f"documents[1].path: document path does not exist: {tmp_path / 'nowhere'}",
        f"documents[2].glob: no files of a known type match '*.pdf' in {tmp_path / 'docs'}",
    ]
    # load_job (as validate and run) gives each its line in the job file
    assert errors_of_files(job) == [
        f"model: no config.json in {tmp_path / 'model'} (expected a checkpoint folder) (line 2)",
        f"requests: no such file: {tmp_path / 'missing.jsonl'} (expected a .jsonl file) (line 3)",
        f"documents[1].path: document path does not exist: {tmp_path / 'nowhere'} (line 6)",
        f"documents[2].glob: no files of a known type match '*.pdf' in {tmp_path / 'docs'} "
        "(line 8)",
    ]
    (tmp_path / "model" / "config.json").write_text("{}")
    # a file of an unknown type named directly is no mistake of the job: it is an error row
    fixed = load_job(job, ["documents=[{path: docs}, {path: notes.docx}]", "requests=null"])
    assert check_paths(fixed) == []


def test_a_job_that_does_not_validate_lists_its_missing_documents_too(tmp_path):
    """A schema mistake and a missing document: both in one listing (the missing document was
    reported only once the schema mistake was fixed); an entry with a mistake of its own is
    not looked for on the disk."""
    job = write(
        tmp_path,
        """\
        name: both
        model: builtin:tiny
        documents:
          - path: nowhere
          - {path: also-missing, format: docx}
        questions: [{text: q}]
        generation: {max_tokens: 0}
        """,
    )
    errors = errors_of_files(job)
    assert f"documents[0].path: document path does not exist: {tmp_path / 'nowhere'} (line 4)" in (
        errors
    )
    assert any(e.startswith("generation.max_tokens:") for e in errors), errors
    assert any(e.startswith("documents[1].format:") for e in errors), errors
    assert not any("also-missing" in e for e in errors), errors
    with pytest.raises(JobValidationError) as schema_only:
        load_job(job)  # without check_files: the schema's mistakes only
    assert not any("nowhere" in e for e in schema_only.value.errors)


def errors_of_files(path: Path, overrides: tuple[str, ...] = ()) -> list[str]:
    with pytest.raises(JobValidationError) as info:
        load_job(path, overrides, check_files=True)
    return info.value.errors


def test_problems_on_disk_name_their_line_or_the_command_line(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.txt").write_text("hello")
    (tmp_path / "out.parquet").mkdir()
    (tmp_path / "theirs.parquet").write_text("not parquet")
    job = write(
        tmp_path,
        """\
        name: lines
        model: builtin:random
        documents: [{path: docs}]
        questions: [{text: q}]
        output:
          path: out.parquet
        """,
    )
    (folder,) = errors_of_files(job)
    assert (
        folder
        == f"output.path: is a folder: {tmp_path / 'out.parquet'} (expected a file path) (line 6)"
    )
    (theirs,) = errors_of_files(job, ("output.path=theirs.parquet",))
    assert theirs.startswith(f"output.path: {tmp_path / 'theirs.parquet'}: ")
    assert theirs.endswith("move the file away (from the command line)")
    with pytest.raises(JobValidationError) as info:
        load_job(job, output=tmp_path / "out.parquet", check_files=True)
    assert info.value.errors[0].endswith("(expected a file path) (from the command line)")
    with pytest.raises(JobValidationError) as info:
        load_job(job, ["output.path=x.parquet"], model=str(tmp_path / "nowhere"), check_files=True)
    assert info.value.errors == [
        f"model: no such folder: {tmp_path / 'nowhere'} (from the command line)"
    ]


def test_an_output_or_cache_under_a_file_is_refused_before_the_run(tmp_path):
    """A results path or cache folder under a file (or a dangling link) cannot be made: the
    run failed making it after the model loaded, and validate said ok."""
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.txt").write_text("hello")
    (tmp_path / "afile").write_text("x")
    (tmp_path / "gone").symlink_to(tmp_path / "nowhere")
    job = write(
        tmp_path,
        """\
        name: under
        model: builtin:random
        documents: [{path: docs}]
        questions: [{text: q}]
        output: {path: afile/out.parquet}
        """,
    )
    assert errors_of_files(job) == [
        f"output.path: cannot make the folder of {tmp_path / 'afile' / 'out.parquet'}: "
        f"{tmp_path / 'afile'} is not a folder (line 5)"
    ]
    (gone,) = errors_of_files(job, ("output.path=gone/x/out.jsonl",))
    assert gone.endswith(f"{tmp_path / 'gone'} is not a folder (from the command line)")
    cache = ("output.path=out.parquet", "cache.dir=afile/cache")
    assert errors_of_files(job, cache) == [
        f"cache.dir: {tmp_path / 'afile'} is not a folder (from the command line)"
    ]
    assert check_paths(load_job(job, (*cache, "cache.enabled=false"))) == []


# ---- identities --------------------------------------------------------------------------------


def test_fingerprint_is_stable_and_follows_the_questions(tmp_path, home):
    job = write(tmp_path, DESIGN_JOB)
    first, again = load_job(job), load_job(job)
    assert spec_fingerprint(first) == spec_fingerprint(again)
    assert len(spec_fingerprint(first)) == 64
    changed = load_job(job, ["questions[1].text=Who signed?"])
    assert spec_fingerprint(changed) != spec_fingerprint(first)
    # The canonical JSON validates back to the same spec (paths are absolute by then).
    assert JobSpec.model_validate_json(spec_json(first)) == first


def test_a_questions_json_schema_or_choices_is_its_pattern(tmp_path):
    """A question may say what its answers must be: JSON its schema validates, or one of its
    choices; a schema outlines-core cannot use, both at once, an empty choice, a choice given
    twice: errors naming the field."""
    job = write(
        tmp_path,
        """\
        name: shaped
        model: builtin:random
        documents: [{path: d}]
        questions:
          - {id: who, text: "Who?", json_schema: {type: object, properties: {a: {type: string}}}}
          - {id: renews, text: "Does it renew?", choices: ["yes", "no", "not stated"]}
          - {id: free, text: "Anything?"}
        """,
    )
    spec = load_job(job)
    who, renews, free = spec.questions
    assert who.pattern().startswith("\\{") and free.pattern() is None
    assert renews.pattern() == "(yes)|(no)|(not stated)"
    bad = write(
        tmp_path,
        """\
        name: shaped
        model: builtin:random
        documents: [{path: d}]
        questions:
          - {text: a, json_schema: {type: object, properties: 5}}
          - {text: b, json_schema: {type: string}, choices: [x]}
          - {text: c, choices: ["x", ""]}
          - {text: d, choices: []}
          - {text: e, choices: ["yes", "no", "yes"]}
        """,
        "bad.yaml",
    )
    errors = errors_of(bad)
    assert [e.split(":")[0] for e in errors] == [
        "questions[0].json_schema",
        "questions[1].choices",
        "questions[2].choices",
        "questions[3].choices",
        "questions[4].choices",
    ], errors
    assert "cannot be used" in errors[0] and "not both" in errors[1]
    assert "'yes' more than once" in errors[4]


@pytest.mark.parametrize(
    ("schema", "keyword"),
    [
        ({"type": "object", "properties": {"n": {"type": "integer", "maximum": 9}}}, "maximum"),
        ({"type": "array", "items": {"const": 1}, "uniqueItems": True}, "uniqueItems"),
        ({"anyOf": [{"type": "integer"}, {"not": {"const": 1}}]}, "not"),
        ({"$defs": {"a": {"type": "string", "if": {}}}, "$ref": "#/$defs/a"}, "if"),
    ],
)
def test_a_schema_keyword_the_grammar_would_not_enforce_is_refused_by_its_path(schema, keyword):
    """outlines-core leaves out what it cannot write (`maximum`, `uniqueItems`, `not`, `if`...):
    the answer broke the schema, as `ok` rows and 200s. Refused, naming where: a job's
    question, a request's response_format. Annotations and a property named as a keyword pass."""
    from salabatch.openai_api import BodyError, structure
    from salabatch.structure import schema_pattern

    with pytest.raises(ValueError, match=rf"\b{keyword} is a keyword the grammar does not enforce"):
        schema_pattern(schema)
    body = {"response_format": {"type": "json_schema", "json_schema": {"schema": schema}}}
    with pytest.raises(BodyError, match=keyword) as e:
        structure(body)
    assert e.value.param == "response_format.json_schema.schema"
    fine = {"type": "object", "title": "t", "properties": {"maximum": {"type": "integer"}}}
    assert schema_pattern(fine).startswith("\\{")


@pytest.mark.parametrize(
    ("schema", "problem"),
    [
        (
            {"allOf": [{"properties": {"a": {"type": "integer"}}}, {"properties": {"b": {}}}]},
            "allOf of more than one schema",  # two JSON values back to back: no JSON at all
        ),
        ({"type": "object", "minProperties": 2}, "minProperties is a keyword"),
        ({"properties": {"a": {"type": "integer"}}, "required": ["b"]}, "required names 'b'"),
        ({"prefixItems": [{}, {}], "minItems": 3}, "beside prefixItems"),
        ({"type": "string", "enum": ["a", 1]}, "value 1 is not of its type 'string'"),
        ({"type": "string", "format": "date"}, "format 'date'"),  # any Unicode digit
        ({"type": "string", "format": "email"}, "format 'email'"),  # unescaped quotes
        ({"properties": {"x": {"additionalProperties": True}}}, "properties.x: additional"),
    ],
)
def test_a_schema_the_pattern_would_not_hold_is_refused(schema, problem):
    """An audit walked the grammars: outlines-core's patterns of these let answers that break
    the schema through (or, for allOf, no valid JSON): refused, naming where."""
    from salabatch.structure import schema_pattern

    with pytest.raises(ValueError, match=re.escape(problem)):
        schema_pattern(schema)
    for fine in (
        {"type": "string", "enum": ["a", "b"]},
        {"type": ["integer", "null"], "enum": [1, 2.0, None]},
        {"properties": {"a": {}}, "required": ["a"], "additionalProperties": False},
        {"type": "string", "format": "date-time"},
        {"allOf": [{"type": "object"}]},
    ):
        schema_pattern(fine)
