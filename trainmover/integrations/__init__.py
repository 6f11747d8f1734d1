"""Integrations for trainers that run the loop themselves (script mode, trainmover/script/owner.py).

lightning.py     a Lightning Callback: `Trainer(callbacks=[TrainMoverCallback()])`
huggingface.py   a transformers TrainerCallback

Each imports its framework; install the extra (`pip install trainmover[lightning]`,
`trainmover[huggingface]`). docs/scripts-trainers.md says what each carries.
"""
