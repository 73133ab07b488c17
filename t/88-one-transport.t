#!/usr/bin/perl

# One transport for every slot call: the idle saver, with no client request
# behind it, talks to llama-server through the slots location as requests
# do.  llama-server here wants an API key, which only the slots location
# gives (proxy_set_header Authorization); the zone has no backend= and no
# api_key=.  The session saved while idle comes back after llama-server
# restarts, and the saves show in the slots location's access log.  On
# the rig's hybrid model (lfm2), whose saves are re-primed: the re-prime's
# calls go the same way.

use strict;
use warnings;

use FindBin;
use lib "$FindBin::Bin/lib";

use LlamaTest;
use Test::More;

my $key = 'sekrit-' . $$;

my $t = LlamaTest->new(workers => 2);
my $lfm2 = LlamaTest::rig_path('make-model.sh lfm2');
my $llama = $t->llama(model => $lfm2, args => [ '--api-key', $key ]);

my $conf = $t->site(
    zone => 'llama_session_zone zone=llama:1m store=%%SLOTS%% save_idle=300ms;',
    upstream => 'keepalive 4;',
    http => q{log_format slots '$uri?$args $status';},
    location => qq{
        proxy_set_header Authorization "Bearer $key";
        proxy_read_timeout 300s;
        add_header X-S-Action \$llama_session_action always;
    },
    slots => qq{
        proxy_http_version 1.1;
        proxy_set_header Connection "";
        proxy_set_header Authorization "Bearer $key";
        log_subrequest on;
        access_log %%DIR%%/slots.log slots;
    });

$t->nginx($conf);

# without the key llama-server refuses the slot calls: only the slots
# location can make them
my $direct = $t->get('/slots', port => $llama);
is($direct->{status}, 401, 'llama-server refuses GET /slots without its key');

my $system = join ' ', map { "Rule $_ holds for every answer." } 1 .. 80;
my $text = join ' ', map { "Dana keeps note $_." } 1 .. 60;

# dana's conversation: each turn sends the replies back and asks again
my @msgs = ({ role => 'system', content => $system },
            { role => 'user', content => $text });

sub ask {
    my $r = $t->post('/v1/chat/completions',
                     { messages => \@msgs, max_tokens => 2,
                       temperature => 0 },
                     headers => { 'X-Session-Id' => 'dana' });
    die "dana: $r->{status} $r->{content}\n" unless $r->{status} == 200;
    push @msgs, { role => 'assistant',
                  content => $r->{json}{choices}[0]{message}{content} },
                { role => 'user', content => 'And then?' };
    return ($r->{json}{usage}{prompt_tokens},
            $r->{json}{usage}{prompt_tokens_details}{cached_tokens},
            $r->{headers}{'x-s-action'});
}

my ($prompt) = ask();
cmp_ok($prompt, '>', 500, "dana's first turn: $prompt prompt tokens");

# dana never leaves the slot: the idle saver keeps her, with the key
ok($t->wait_for(sub { $t->log_lines(qr/idle save of "dana-\w+" from slot 0 of zone "llama": \d+ tokens/) }, 20),
   'the idle save of dana is logged');
my @files = glob($t->dir . '/slots/dana-*.bin');
is(scalar @files, 1, 'dana has a file in the store');
cmp_ok(-s $files[0], '>', 100_000, 'a whole state: ' . (-s $files[0])
                                    . ' bytes');
ok(!$t->log_lines(qr/\[(?:error|crit|alert)\]/),
   'no error on the way (no 401 from llama-server)');

my $log = $t->read_file($t->dir . '/slots.log');
like($log, qr{^/_llama_slots/slots\?- 200\n/_llama_slots/apply-template\?- 200\n/_llama_slots/tokenize\?- 200\n/_llama_slots/apply-template\?- 200\n/_llama_slots/tokenize\?- 200\n/_llama_slots/completion\?- 200\n/_llama_slots/slots/0\?action=save 200$}m,
     "the idle saver's GET /slots, its re-prime (two renders, their "
     . 'tokens and the completion) and save went through the slots location');

# a reboot: the slot is empty, dana comes back from her idle-saved file
$t->stop_nginx;
$t->stop_llama;
$t->llama(port => $llama, model => $lfm2, args => [ '--api-key', $key ]);
$t->start_nginx;

my ($p2, $cached, $action) = ask();
is($action, 'restore', 'after the reboot dana is restored');
cmp_ok($cached, '>=', $prompt - 4,
       "dana's cache is back: $cached of $p2 tokens cached");

$t->stop;
done_testing;
