"""The model: GPTConfig and GPT (blocks, attention kernels), published shapes, checkpoints read without trust, loss.
May import: labutils.core, labutils.text."""
from labutils.model.checkpoints import (DATA_DIR, load_checkpoint, load_hf_gpt2, load_pretrained, save_checkpoint,
                                        save_hf_gpt2)
from labutils.model.gpt import GPT, MLP, Block, CausalSelfAttention, GPTConfig, RMSNorm, rope
from labutils.model.loss import heldout_loss, unigram_loss
from labutils.model.presets import PRESETS, ModelShape, get_shape
