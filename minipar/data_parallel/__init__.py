"""The data-parallel family: the protocol every strategy answers (`strategy`), DDP (`ddp`), ZeRO-1/2
(`zero12`), ZeRO-3/FSDP and HSDP (`zero3`, its turn-taking `unit_turns`), their shared parts
(gradient `buckets`, the `flat` layout, mixed `precision`, the sharded state and optimizer,
`offload` to host or `disk`), uneven data (`join`), and the alternatives: 1-bit Adam
(`onebit`), the parameter server (`parameter_server`) and single-process DataParallel
(`single_process`)."""
