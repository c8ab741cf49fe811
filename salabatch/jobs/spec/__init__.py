"""The job file: what a job is (`models`), how it is read (`load`: YAML with its lines in
`job_yaml`, the command line, a bare requests file, what the disk lacks) and how its mistakes
are worded (`errors`)."""
