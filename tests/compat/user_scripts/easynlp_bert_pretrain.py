"""A user's BERT pretraining of a Hugging Face model in the shape of EasyNLP's Rapidformer example: a PreTrainer
whose data are Megatron indexed sentences (--data-path, tokenized by --vocab-file) turned into
BertForPreTraining's keywords by build_pretrain_huggingface_bert_datasets, written against rapidtrain."""

from transformers import BertForPreTraining

from rapidtrain import PreTrainer, RapidformerEngine, build_pretrain_huggingface_bert_datasets, get_args


class HuggingFaceBertPreTrainer(PreTrainer):
    def train_valid_test_datasets_provider(self, train_val_test_num_samples):
        args = get_args()
        return build_pretrain_huggingface_bert_datasets(
            data_prefix=args.data_path, data_impl=args.data_impl, splits_string=args.split,
            train_valid_test_num_samples=train_val_test_num_samples, max_seq_length=args.seq_length,
            masked_lm_prob=args.mask_prob, short_seq_prob=args.short_seq_prob, seed=args.seed, binary_head=True)

    def model_optimizer_lr_scheduler_provider(self):
        return BertForPreTraining.from_pretrained(get_args().pretrained_model_name_or_path), None, None

    def run_forward_step(self, data_iterator, model):
        device = next(model.parameters()).device
        batch = {name: value.to(device) for name, value in next(data_iterator).items()}
        return model(**batch).loss


if __name__ == "__main__":
    HuggingFaceBertPreTrainer(engine=RapidformerEngine()).train()
