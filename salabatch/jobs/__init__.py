"""The batch pipeline, as the stages a document goes through: the job file (`spec`), its files
read into Documents (`ingest`), each prefilled once and its questions answered (`run`, with the
prefix caches of `store`), the rows written and read back (`results`); `ray` runs the same job
across the machines of a Ray cluster."""
