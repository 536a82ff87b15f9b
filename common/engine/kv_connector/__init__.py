"""The one seam through which KV enters and leaves the engine (vLLM's KVConnectorBase_V1
shape): a scheduler half next to the Scheduler and a worker half next to the model runner,
talking only through plain data carried in SchedulerOutput and RunnerOutput."""
