"""Triton adapters for `preprocessing` (text -> token ids) and `postprocessing` (ids -> text)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from specdec import tensor_names as tn
from specdec.decoding.text import (CONTENT_FORMATS, chat_ids, chat_messages, chat_template_kwargs, chat_tools,
                                   check_chat_template, decode_delta, load_tokenizer, read_chat_template,
                                   request_template)
from specdec.triton.adapter import TritonAdapter
from specdec.triton.admission.cancellation import CancellationBoard
from specdec.triton.config import ModelParameters
from specdec.triton.execute_clock import ExecuteClock


class PreprocessingAdapter(TritonAdapter):
    def load(self, params: ModelParameters, args: dict) -> None:
        template = self._chat_template(params, args)
        self.tokenizer = load_tokenizer(params.str("tokenizer_path"), template)
        self.content_format = params.str("chat_template_content_format", "auto")
        if self.content_format not in CONTENT_FORMATS:
            raise ValueError(f"{params.model_name}: parameter 'chat_template_content_format' must be one of "
                             f"{', '.join(CONTENT_FORMATS)}, got {self.content_format!r}")
        if template:  # a template that cannot render a plain chat fails the load, not every request
            check_chat_template(self.tokenizer, f"{params.model_name}: parameter 'chat_template'", self.content_format)
        self.chat_template_default = params.bool("apply_chat_template", False)
        self.trust_request_templates = params.bool("trust_request_chat_template", False)
        if self.chat_template_default and not self.tokenizer.chat_template:
            raise ValueError(f"{params.model_name}: parameter 'apply_chat_template' is true but the tokenizer has no chat template")
        self.execute_clock = ExecuteClock(args["model_instance_name"])  # the watchdog's view of a hang

    @staticmethod
    def _chat_template(params: ModelParameters, args: dict) -> str | None:
        """Parameter `chat_template`: a Jinja file replacing the tokenizer's template (vLLM's --chat-template),
        its path absolute or relative to the model's directory (where the launcher and the chart put it);
        "" = the tokenizer's own."""
        name = params.str("chat_template", "")
        if not name:
            return None
        path = Path(args.get("model_repository", "")) / name  # an absolute name stays itself
        field = f"{params.model_name}: parameter 'chat_template'"
        if not path.is_file():
            raise ValueError(f"{field}: {str(path)!r} is not a file")
        return read_chat_template(str(path), field)

    def execute(self, requests):
        with self.execute_clock:
            return self._execute(requests)

    def _execute(self, requests):
        pb = self.pb
        responses = []
        for request in requests:
            try:
                self._check_fixed_inputs(request)
                ids = self._encode(request)
                responses.append(pb.InferenceResponse(output_tensors=[
                    pb.Tensor(tn.INPUT_IDS, np.asarray([ids], dtype=np.int32)),
                    pb.Tensor(tn.INPUT_LENGTH, np.asarray([[len(ids)]], dtype=np.int32)),
                ]))
            except ValueError as exc:
                responses.append(pb.InferenceResponse(error=pb.TritonError(str(exc), pb.TritonError.INVALID_ARG)))
        return responses

    def _check_fixed_inputs(self, request) -> None:
        """TensorRT-LLM's clients send beam_width, num_return_sequences and pad_id: the one value of the
        first two that speculative decoding serves is accepted, any other refused by name; pad_id is checked
        and has no effect (exclude_input_in_output is speculative_decoding's)."""
        for name, dtype, supported, why in (
                (tn.BEAM_WIDTH, np.int32, 1, "speculative decoding decodes one sequence (no beam search)"),
                (tn.NUM_RETURN_SEQUENCES, np.int32, 1, "one sequence a request; OpenAI's n is the gateway's")):
            tensor = self.pb.get_input_tensor_by_name(request, name)
            if tensor is None:
                continue
            value = tensor.as_numpy().reshape(-1)
            if value.dtype != dtype or value.size != 1 or value[0].item() != supported:
                raise ValueError(f"input '{name}' must be {str(supported).lower()} here ({why}), got {value.tolist()}")
        pad_id = self.pb.get_input_tensor_by_name(request, tn.PAD_ID)  # TensorRT-LLM pads beams with it; no beams here
        pad_ids = None if pad_id is None else pad_id.as_numpy().reshape(-1)
        if pad_ids is not None and (pad_ids.size != 1 or pad_ids[0] < 0):
            raise ValueError(f"input '{tn.PAD_ID}' must be one token id >= 0, got {pad_ids.tolist()}")

    def _encode(self, request) -> list[int]:
        pb = self.pb
        chat_tensor = pb.get_input_tensor_by_name(request, tn.MESSAGES)
        tensor = pb.get_input_tensor_by_name(request, tn.TEXT_INPUT)
        tools_tensor = pb.get_input_tensor_by_name(request, tn.TOOLS)
        ids_tensor = pb.get_input_tensor_by_name(request, tn.PROMPT_TOKEN_IDS)
        kwargs_tensor = pb.get_input_tensor_by_name(request, tn.CHAT_TEMPLATE_KWARGS)
        template_kwargs = None if kwargs_tensor is None else chat_template_kwargs(
            _one_string(kwargs_tensor, tn.CHAT_TEMPLATE_KWARGS), tn.CHAT_TEMPLATE_KWARGS)
        template = self._request_template(request)
        continued = pb.get_input_tensor_by_name(request, tn.CONTINUE_FINAL_MESSAGE)
        continue_final = continued is not None and bool(continued.as_numpy().reshape(-1)[0])
        if continue_final and chat_tensor is None:
            raise ValueError(f"input '{tn.CONTINUE_FINAL_MESSAGE}' needs '{tn.MESSAGES}' (a chat whose last "
                             "message, the assistant's, it continues)")
        if ids_tensor is not None:
            if template_kwargs is not None or template is not None:
                name = tn.CHAT_TEMPLATE if template is not None else tn.CHAT_TEMPLATE_KWARGS
                raise ValueError(f"input '{name}' needs a chat template applied; "
                                 f"'{tn.PROMPT_TOKEN_IDS}' are the prompt as it is")
            given = [name for name, t in ((tn.TEXT_INPUT, tensor), (tn.MESSAGES, chat_tensor)) if t is not None]
            if given:
                raise ValueError(f"inputs '{tn.PROMPT_TOKEN_IDS}' and '{given[0]}' exclude each other: send one")
            return prompt_token_ids(ids_tensor.as_numpy(), len(self.tokenizer), tn.PROMPT_TOKEN_IDS)
        if tools_tensor is not None and chat_tensor is None:
            raise ValueError(f"input '{tn.TOOLS}' needs '{tn.MESSAGES}' (the chat template renders them)")
        if chat_tensor is not None:
            if tensor is not None:
                raise ValueError(f"inputs '{tn.TEXT_INPUT}' and '{tn.MESSAGES}' exclude each other: send one")
            if not self.tokenizer.chat_template and template is None:
                raise ValueError(f"input '{tn.MESSAGES}' needs a chat template, and the tokenizer has none")
            messages = chat_messages(_one_string(chat_tensor, tn.MESSAGES), tn.MESSAGES)
            tools = None if tools_tensor is None else chat_tools(_one_string(tools_tensor, tn.TOOLS), tn.TOOLS)
            return chat_ids(self.tokenizer, messages, tools, tn.MESSAGES, template_kwargs, template, self.content_format,
                            continue_final)
        if tensor is None:
            raise ValueError(f"input '{tn.TEXT_INPUT}' is required (the prompt; or '{tn.MESSAGES}', a chat, or "
                             f"'{tn.PROMPT_TOKEN_IDS}')")
        text = _one_string(tensor, tn.TEXT_INPUT)
        if not text.strip():
            raise ValueError(f"input '{tn.TEXT_INPUT}' is empty")
        chat = pb.get_input_tensor_by_name(request, tn.APPLY_CHAT_TEMPLATE)
        use_chat = self.chat_template_default if chat is None else bool(chat.as_numpy().reshape(-1)[0])
        if use_chat:
            if not self.tokenizer.chat_template and template is None:
                raise ValueError(f"input '{tn.APPLY_CHAT_TEMPLATE}' is true but the tokenizer has no chat template")
            return chat_ids(self.tokenizer, [{"role": "user", "content": text}], None, tn.APPLY_CHAT_TEMPLATE,
                            template_kwargs, template, self.content_format)
        if template_kwargs is not None or template is not None:
            name = tn.CHAT_TEMPLATE if template is not None else tn.CHAT_TEMPLATE_KWARGS
            raise ValueError(f"input '{name}' needs a chat template applied: '{tn.MESSAGES}', or "
                             f"'{tn.APPLY_CHAT_TEMPLATE}' true")
        return self.tokenizer.encode(text, add_special_tokens=True)

    def _request_template(self, request) -> str | None:
        """The request's own chat template (tn.CHAT_TEMPLATE), where the server takes one."""
        tensor = self.pb.get_input_tensor_by_name(request, tn.CHAT_TEMPLATE)
        if tensor is None:
            return None
        if not self.trust_request_templates:
            raise ValueError(f"input '{tn.CHAT_TEMPLATE}': this server does not take a request's chat template (a "
                             "template is code it would run); started with --trust-request-chat-template it does")
        return request_template(_one_string(tensor, tn.CHAT_TEMPLATE), f"input '{tn.CHAT_TEMPLATE}'")


def prompt_token_ids(values: np.ndarray, vocab_size: int, name: str) -> list[int]:
    """A prompt given as token ids, checked: at least one, each within the tokenizer's vocabulary."""
    ids = values.reshape(-1)
    if ids.size == 0:
        raise ValueError(f"input '{name}' is empty: the prompt needs at least one token")
    bad = ids[(ids < 0) | (ids >= vocab_size)]
    if bad.size:
        raise ValueError(f"input '{name}' must hold token ids within [0, {vocab_size}), got {int(bad[0])}")
    return ids.astype(np.int64).tolist()


def _one_string(tensor, name: str) -> str:
    raw = tensor.as_numpy().reshape(-1)
    if raw.size != 1:
        raise ValueError(f"input '{name}' must hold exactly one string, got {raw.size}")
    value = raw[0]
    try:
        return value.decode("utf-8") if isinstance(value, bytes) else str(value)
    except UnicodeDecodeError as exc:
        raise ValueError(f"input '{name}' is not valid UTF-8 ({exc.reason} at byte {exc.start})") from None


class PostprocessingAdapter(TritonAdapter):
    def load(self, params: ModelParameters, args: dict) -> None:
        self.tokenizer = load_tokenizer(params.str("tokenizer_path"))
        self.cancellations = CancellationBoard()
        self.execute_clock = ExecuteClock(args["model_instance_name"])  # the watchdog's view of a hang

    def execute(self, requests):
        with self.execute_clock:
            return self._execute(requests)

    def _execute(self, requests):
        pb = self.pb
        responses = []
        for request in requests:
            if request.is_cancelled():
                # The client cancelled the ensemble: tell the still-running orchestrator (see cancellation.py).
                key = pb.get_input_tensor_by_name(request, tn.SEQUENCE_ID)
                if key is not None:
                    self.cancellations.cancel(int(key.as_numpy().reshape(-1)[0]))

            ids = pb.get_input_tensor_by_name(request, tn.OUTPUT_IDS).as_numpy().reshape(-1).tolist()
            prefix_tensor = pb.get_input_tensor_by_name(request, tn.PREFIX_IDS)
            prefix = [] if prefix_tensor is None else prefix_tensor.as_numpy().reshape(-1).tolist()
            skip = pb.get_input_tensor_by_name(request, tn.SKIP_SPECIAL_TOKENS)
            skip_special = True if skip is None else bool(skip.as_numpy().reshape(-1)[0])
            text = decode_delta(self.tokenizer, prefix, ids, skip_special) if ids else ""
            length_tensor = pb.get_input_tensor_by_name(request, tn.TEXT_LENGTH)
            length = -1 if length_tensor is None else int(length_tensor.as_numpy().reshape(-1)[0])
            if length >= 0:  # the orchestrator cut the text at a stop word inside these tokens
                text = text[:length]
            responses.append(pb.InferenceResponse(output_tensors=[
                pb.Tensor(tn.TEXT_OUTPUT, np.array([[text.encode("utf-8")]], dtype=np.object_))]))
        return responses
