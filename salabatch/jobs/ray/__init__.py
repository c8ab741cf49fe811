"""`salabatch run --executor ray`: the driver (`executor`) lists the job as units a worker can do
alone (`manifest`), and model actors (`worker`) answer them on the machines of a Ray cluster."""
