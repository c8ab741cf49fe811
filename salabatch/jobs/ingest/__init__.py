"""Stage 1 of a job: the files, folders and globs of `documents:` become `Document`s (`documents`),
their text decoded (`text`) or extracted from PDFs (`pdf`); a document that cannot be read is
still a Document, with its reason."""
