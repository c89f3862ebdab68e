"""FAKE NxD Inference (``neuronx_distributed_inference``) for tests only: the Neuron SDK cannot be
installed off Trainium. It mirrors the SDK boundary the Neuron runner uses, nothing more:

- ``models/config.py``: ``NeuronConfig`` accepting exactly the keyword arguments of NxDI's own
  (their names checked against aws-neuron/neuronx-distributed-inference ``models/config.py``), so a
  misspelt or invented argument fails here (NxDI itself would only log a warning and ignore it).
- ``utils/hf_adapter.py``: ``load_pretrained_config``.
- ``models/{llama,qwen3}``: causal-LM classes whose ``compile``/``load``/``forward`` follow NxDI's
  contract: ``forward(input_ids, seq_ids, attention_mask, position_ids)`` routes to the prefill graph
  when the smallest position is 0, to the speculation graph when the input has exactly
  ``speculation_length`` tokens, to the 1-token graph otherwise (absent when speculation_length > 0);
  KV entries are written at their positions and a decode attends to the cached positions its
  attention mask marks. The numbers come from the project's torch forward, so outputs can be
  compared with the torch runner.
"""
