"""Answers scored against an answer key (`inspect --expected`): matching up to case, spacing and
edge punctuation, documents named by file name, path end or doc_id, failed and missing rows,
and keys refused with the entry named."""

from __future__ import annotations

import re

import pytest
from click.testing import CliRunner

from salabatch.cli import main
from salabatch.errors import JobSpecError
from salabatch.jobs.results.answer_key import normalize, read_answer_key, report, score
from salabatch.jobs.results.read import read_results
from tests.jobs.results.test_results import make_row, writer


@pytest.fixture
def results(tmp_path):
    path = tmp_path / "r.parquet"
    with writer(path) as out:
        out.write(
            [
                make_row("a.code", answer=" Harbor  lane Ltd.\n"),
                make_row("a.amount", answer="$12,400 and more"),
                make_row("b.code", answer="739258"),
                make_row("b.amount", status="error", error="out of memory"),
            ]
        )
    return path


def _key(tmp_path, text: str):
    path = tmp_path / "key.yaml"
    path.write_text(text)
    return path


def test_normalize_ignores_case_spacing_and_edge_punctuation_only():
    assert normalize(' "Harbor  Lane\nLtd." ') == "harbor lane ltd"
    assert normalize("$12,400") == "$12,400"  # inside the value, punctuation counts
    assert normalize("12.400") != normalize("12400")


def test_every_expected_answer_is_scored_beside_its_row(tmp_path, results):
    key_path = _key(
        tmp_path,
        "a.pdf:\n  code: harbor lane ltd\n  amount: $12,400\n"
        "data/b.pdf:\n  code: 739258\n  amount: '5'\n",
    )
    scored = score(read_results(results), read_answer_key(key_path), key_path)
    assert [(s.document, s.question_id, s.right) for s in scored] == [
        ("a.pdf", "code", True),
        ("a.pdf", "amount", False),  # more than the value
        ("data/b.pdf", "code", True),  # YAML's integer read back as text
        ("data/b.pdf", "amount", False),
    ]
    assert scored[3].error == "out of memory" and scored[3].answer is None
    text = report(scored)
    assert text.splitlines()[-1] == "2 of 4 answers correct"
    assert '✗ data/b.pdf  amount  expected "5"  got "(error: out of memory)"' in text
    assert '✓ a.pdf       code    expected "harbor lane ltd"  got "Harbor lane Ltd."' in text


def test_an_expected_answer_is_the_text_written_not_a_yaml_number(tmp_path):
    key = read_answer_key(_key(tmp_path, "a.pdf: {code: 010, rate: 1.50, ok: yes, n: 1e3}\n"))
    assert key == {"a.pdf": {"code": "010", "rate": "1.50", "ok": "yes", "n": "1e3"}}


def test_a_document_is_named_by_doc_id_and_a_request_not_run_yet_is_wrong(tmp_path):
    path = tmp_path / "r.parquet"
    with writer(path) as out:  # two records of one .jsonl file: one path, two doc_ids
        out.write([make_row("r1.q", answer="x"), make_row("r2.q", answer="y", doc_path="/d.jsonl")])
    table = read_results(path)
    key_path = _key(tmp_path, "r1:\n  q: x\nr2:\n  q: y\n")
    assert [s.right for s in score(table, read_answer_key(key_path), key_path)] == [True, True]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("- a\n- b\n", "must map documents to {question id: expected answer}"),
        ("a.pdf: 5\n", "a.pdf: must map question ids to expected answers"),
        ("a.pdf:\n  code: [1, 2]\n", "a.pdf.code: an expected answer must be text or a number"),
        ("a.pdf:\n  code: [1\n", "invalid YAML at line 3, column 1"),
        ("a.pdf:\n  code: 1\n  code: 2\n", "a.pdf.code: duplicate key (line 3; first at line 2)"),
        ("a.pdf: {code: 1}\nb.pdf: {}\na.pdf: {x: 2}\n", "a.pdf: duplicate key (line 3; first"),
        ('a.pdf: {code: "\x01"}\n', "invalid YAML at line 1, column 16: character U+0001"),
    ],
)
def test_a_malformed_key_is_refused_naming_the_entry(tmp_path, text, message):
    with pytest.raises(JobSpecError, match=re.escape("key.yaml: " + message)):
        read_answer_key(_key(tmp_path, text))


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("z.pdf:\n  code: 1\n", r"z.pdf: no document of the results has this name \(expected "),
        ("a.pdf:\n  colour: red\n", r"a.pdf.colour: no such question in the results"),
    ],
)
def test_a_key_that_names_no_document_or_question_is_refused(tmp_path, results, text, message):
    key_path = _key(tmp_path, text)
    with pytest.raises(JobSpecError, match=message):
        score(read_results(results), read_answer_key(key_path), key_path)


def test_one_name_for_two_documents_is_refused(tmp_path):
    path = tmp_path / "r.parquet"
    with writer(path) as out:
        out.write(
            [
                make_row("a.q", doc_path="/x/doc.txt"),
                make_row("b.q", doc_path="/y/doc.txt"),
            ]
        )
    key_path = _key(tmp_path, "doc.txt:\n  q: 1\n")
    with pytest.raises(JobSpecError, match="names 2 documents .*give more of the path"):
        score(read_results(path), read_answer_key(key_path), key_path)
    key_path = _key(tmp_path, "y/doc.txt:\n  q: 1\n")
    assert score(read_results(path), read_answer_key(key_path), key_path)[0].document == "y/doc.txt"
    # one document's doc_id and another's file name: bound to the doc_id without a word
    path = tmp_path / "ids.parquet"
    with writer(path) as out:
        out.write(
            [
                make_row("a.q", doc_id="x.txt", doc_path="/A/x.txt"),
                make_row("b.q", doc_id="x.txt~2", doc_path="/B/x.txt"),
            ]
        )
    key_path = _key(tmp_path, "x.txt:\n  q: 1\n")
    with pytest.raises(JobSpecError, match=r"names 2 documents \(x.txt, x.txt~2\)"):
        score(read_results(path), read_answer_key(key_path), key_path)


def test_inspect_expected_prints_the_comparison_and_the_count(tmp_path, results):
    key_path = _key(tmp_path, "a.pdf:\n  code: harbor lane ltd\n")
    out = CliRunner().invoke(main, ["inspect", str(results), "--expected", str(key_path)])
    assert out.exit_code == 0, out.output
    assert "expected answers\n✓ a.pdf  code" in out.output
    assert out.output.rstrip().endswith("1 of 1 answers correct")
    bad = CliRunner().invoke(main, ["inspect", str(results), "--expected", str(tmp_path / "no")])
    assert bad.exit_code == 2 and "cannot read the answer key" in bad.output
